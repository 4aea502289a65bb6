"""Serving benchmark: the OpenAI-compatible server over loopback, plain decoding against MTP.

The serving guide's grid (its section 11): input short / medium / long, output short / long,
concurrency 1 / 4 / saturating (2 x --max-batch: requests queue), sampling greedy / low temperature
/ top-p, speculation off against MTP depth K = 1..3 (`vanilla`: the model's own modules, one per
depth). The baseline and MTP share the model, weights, server settings and workload: each
request's prompt (token ids from held-out stdlib files), max_tokens (`ignore_eos`, so lengths are
exact) and seed.

One server per speculation setting (`python -m mtp_jax.cli serve ...`, started here, waited for on
`/health`, warmed up, shut down after its cells). Each cell sends its requests closed-loop at its
concurrency with the `openai` async client, streaming, and measures per request: TTFT (send to the
first chunk with text), inter-chunk gaps (ITL: one chunk per engine step, so per step, not per
token), TPOT ((last chunk - first) / (tokens - 1)); per cell: output tokens/s over the cell's wall
time, and from `/metrics` deltas the mean acceptance length (1 + accepted / drafts), per-position
acceptance rates and the server's own counts; `vllm:kv_cache_usage_perc` and the running / waiting
gauges are sampled every 0.1 s while the cell runs.

Bounded: --max-cells (workload x setting), --time-budget (seconds, split evenly over the servers;
cells past it are listed as skipped). `--smoke` runs 4 tiny cells (short in, 16 tokens out,
concurrency 1 and 4, greedy; off and K=2) on a small server in under 2 minutes on a 2-core CPU.

    python benchmarks/bench_serving.py [--smoke] [--speculative none vanilla:1 vanilla:2 vanilla:3]
        [--inputs short medium long] [--outputs short long] [--concurrency 1 4 sat]
        [--sampling greedy low_temp top_p] [--max-cells N] [--time-budget S] [--out benchmarks/results]

Writes serving_<device>_<date>[_smoke].json and .md (and a .png when matplotlib is installed).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import importlib.metadata
import itertools
import json
import os
import platform
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from datetime import date
from pathlib import Path

import numpy as np
from prometheus_client.parser import text_string_to_metric_families
from tokenizers import Tokenizer

INPUT_LENGTHS = {"short": 32, "medium": 256, "long": 768}
OUTPUT_LENGTHS = {"short": 32, "long": 256}
SAMPLING = {
    "greedy": {"temperature": 0.0},
    "low_temp": {"temperature": 0.3},
    "top_p": {"temperature": 1.0, "top_p": 0.9},
}
GAUGE_INTERVAL_S = 0.1  # /metrics polls while a cell runs (each costs the server a render)
SMOKE = dict(
    inputs=["short"],
    outputs=["short"],
    concurrency=["1", "4"],
    sampling=["greedy"],
    speculative=["none", "vanilla:2"],
    max_batch=4,
    max_length=128,
    prefill_chunk=32,
    output_short=16,
    requests_per_cell=8,
)


# ----------------------------------------------------------------------------------------------
# The workload


def heldout_tokens(tokenizer: Tokenizer) -> np.ndarray:
    """The held-out stdlib files' tokens, concatenated in path order (the demo model never trained on them)."""
    from mtp_jax.training import data

    _, heldout = data.split_documents(data.stdlib_documents())
    return np.concatenate([np.asarray(tokenizer.encode(heldout[name]).ids, np.int64) for name in sorted(heldout)])


def prompts_for(tokens: np.ndarray, length: int, count: int) -> list[list[int]]:
    """`count` distinct windows of `length` tokens, the same for every speculation setting."""
    span = len(tokens) - length
    return [tokens[(i * 7919) % span : (i * 7919) % span + length].tolist() for i in range(count)]


def parse_speculative(spec: str) -> tuple[str, int]:
    """ "none" -> ("none", 0); "vanilla:2" -> ("vanilla", 2)."""
    method, _, k = spec.partition(":")
    if method == "none":
        return "none", 0
    if not k.isdigit() or int(k) < 1:
        raise argparse.ArgumentTypeError(f"speculative setting {spec!r}: expected none or METHOD:K (K >= 1)")
    return method, int(k)


def workloads(args) -> list[dict]:
    cells = []
    for sampling, inp, out, conc in itertools.product(args.sampling, args.inputs, args.outputs, args.concurrency):
        concurrency = 2 * args.max_batch if conc == "sat" else int(conc)
        cells.append(
            dict(
                input=inp,
                output=out,
                concurrency_name=conc,
                concurrency=concurrency,
                sampling=sampling,
                input_tokens=INPUT_LENGTHS[inp],
                output_tokens=args.output_short if out == "short" else OUTPUT_LENGTHS[out],
                num_requests=max(args.requests_per_cell, 2 * concurrency),
            )
        )
    fitting = [w for w in cells if w["input_tokens"] + w["output_tokens"] <= args.max_length]
    if len(fitting) < len(cells):
        print(f"{len(cells) - len(fitting)} workloads do not fit --max-length {args.max_length}: left out")
    return fitting


# ----------------------------------------------------------------------------------------------
# The server


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def http_get(url: str, timeout: float = 10.0) -> str:
    with urllib.request.urlopen(url, timeout=timeout) as response:
        return response.read().decode()


class Server:
    """`mtp-jax serve` in a subprocess for one speculation setting; a context manager."""

    def __init__(self, args, method: str, k: int, log_dir: Path):
        self.method, self.k, self.port = method, k, free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_dir / f"server_{method}_{k}.log"
        self.command = [
            sys.executable,
            "-m",
            "mtp_jax.cli",
            "serve",
            *([args.model] if args.model else []),
            "--speculative",
            method,
            *(["--num-speculative-tokens", str(k)] if k else []),
            "--max-batch",
            str(args.max_batch),
            "--max-length",
            str(args.max_length),
            "--prefill-chunk",
            str(args.prefill_chunk),
            "--max-queue",
            str(args.max_queue),
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
            "--served-model-name",
            args.served_model_name,
        ]
        self.timeout = args.server_timeout
        self.process = None

    def __enter__(self) -> Server:
        self._log = open(self.log_path, "w")  # closed in __exit__
        start = time.perf_counter()
        self.process = subprocess.Popen(self.command, stdout=self._log, stderr=subprocess.STDOUT)
        while True:
            with contextlib.suppress(OSError):
                http_get(self.url + "/health", timeout=2)
                break
            failed = (
                f"the server exited with {self.process.returncode}"
                if self.process.poll() is not None
                else f"no /health after {self.timeout} s"
                if time.perf_counter() - start > self.timeout
                else None
            )
            if failed:
                self.__exit__(None, None, None)
                raise RuntimeError(f"{failed} ({' '.join(self.command)}):\n{self.log_tail()}")
            time.sleep(0.5)
        self.startup_s = time.perf_counter() - start
        return self

    def __exit__(self, *exc) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.send_signal(signal.SIGINT)  # uvicorn's graceful shutdown
            try:
                self.process.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        self._log.close()

    def log_tail(self, lines: int = 30) -> str:
        return "".join(self.log_path.read_text(errors="replace").splitlines(keepends=True)[-lines:])

    def scrape(self, model_name: str) -> dict[str, float]:
        """/metrics of `model_name`: {sample name (per_pos: name[position]): value}."""
        values = {}
        for family in text_string_to_metric_families(http_get(self.url + "/metrics")):
            for s in family.samples:
                if s.labels.get("model_name") != model_name or s.name.endswith("_bucket"):
                    continue
                key = s.name + (f"[{s.labels['position']}]" if "position" in s.labels else "")
                if "finished_reason" in s.labels:
                    key += f"[{s.labels['finished_reason']}]"
                values[key] = values.get(key, 0.0) + s.value
        return values


# ----------------------------------------------------------------------------------------------
# Requests


async def one_request(client, model: str, prompt: list[int], max_tokens: int, sampling: dict, seed: int) -> dict:
    """One streamed completion: its chunk arrival times (seconds since it was sent) and usage."""
    start = time.perf_counter()
    stream = await client.completions.create(
        model=model,
        prompt=prompt,
        max_tokens=max_tokens,
        stream=True,
        stream_options={"include_usage": True},
        seed=seed,
        extra_body={"ignore_eos": True},
        **sampling,
    )
    times, usage = [], None
    async for chunk in stream:
        if chunk.choices and chunk.choices[0].text:
            times.append(time.perf_counter() - start)
        if chunk.usage is not None:
            usage = chunk.usage
    latency = time.perf_counter() - start
    tokens = usage.completion_tokens if usage else None
    return dict(
        latency=latency,
        ttft=times[0] if times else None,
        itl=np.diff(times).tolist(),
        tpot=(times[-1] - times[0]) / (tokens - 1) if times and tokens and tokens > 1 else None,
        completion_tokens=tokens,
        prompt_tokens=usage.prompt_tokens if usage else None,
    )


async def sample_gauges(server: Server, model: str, samples: list, stop: asyncio.Event) -> None:
    while not stop.is_set():
        with contextlib.suppress(OSError):
            m = await asyncio.to_thread(server.scrape, model)
            samples.append(
                (
                    m.get("vllm:kv_cache_usage_perc", 0.0),
                    m.get("vllm:num_requests_running", 0.0),
                    m.get("vllm:num_requests_waiting", 0.0),
                )
            )
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), GAUGE_INTERVAL_S)


async def run_cell(server: Server, args, work: dict, prompts: list[list[int]]) -> dict:
    from openai import AsyncOpenAI

    client = AsyncOpenAI(base_url=server.url + "/v1", api_key="EMPTY", max_retries=0, timeout=args.request_timeout)
    model, sampling = args.served_model_name, SAMPLING[work["sampling"]]
    before = await asyncio.to_thread(server.scrape, model)
    gauges, stop = [], asyncio.Event()
    sampler = asyncio.create_task(sample_gauges(server, model, gauges, stop))
    limit, errors = asyncio.Semaphore(work["concurrency"]), []

    async def bounded(i):
        async with limit:
            try:
                return await one_request(client, model, prompts[i], work["output_tokens"], sampling, seed=1000 + i)
            except Exception as e:  # a failed request is counted and reported; the cell goes on
                errors.append(f"{type(e).__name__}: {e}")
                return None

    start = time.perf_counter()
    results = [r for r in await asyncio.gather(*(bounded(i) for i in range(work["num_requests"]))) if r]
    wall = time.perf_counter() - start
    stop.set()
    await sampler
    after = await asyncio.to_thread(server.scrape, model)
    await client.close()
    return summarize(work, server, results, errors, wall, before, after, gauges)


def stats_ms(values) -> dict:
    values = [v for v in values if v is not None]
    if not values:
        return dict(mean=None, p50=None, p99=None)
    return {
        name: float(f(values)) * 1e3
        for name, f in (("mean", np.mean), ("p50", np.median), ("p99", lambda v: np.percentile(v, 99)))
    }


def summarize(work, server, results, errors, wall, before, after, gauges) -> dict:
    delta = {key: after.get(key, 0.0) - before.get(key, 0.0) for key in after}
    out_tokens = sum(r["completion_tokens"] or 0 for r in results)
    drafts = delta.get("vllm:spec_decode_num_drafts_total", 0.0)
    accepted = delta.get("vllm:spec_decode_num_accepted_tokens_total", 0.0)
    per_pos = [delta.get(f"vllm:spec_decode_num_accepted_tokens_per_pos_total[{j}]", 0.0) for j in range(server.k)]
    ttft_count = delta.get("vllm:time_to_first_token_seconds_count", 0.0)
    kv = [g[0] for g in gauges]
    return dict(
        **work,
        method=server.method,
        k=server.k,
        completed=len(results),
        errors=errors[:5],
        num_errors=len(errors),
        wall_s=wall,
        completion_tokens_total=out_tokens,
        prompt_tokens_total=sum(r["prompt_tokens"] or 0 for r in results),
        output_tok_s=out_tokens / wall if wall else None,
        requests_s=len(results) / wall if wall else None,
        ttft_ms=stats_ms(r["ttft"] for r in results),
        tpot_ms=stats_ms(r["tpot"] for r in results),
        itl_ms=stats_ms(itertools.chain.from_iterable(r["itl"] for r in results)),
        e2e_ms=stats_ms(r["latency"] for r in results),
        acceptance_length=1.0 + accepted / drafts if drafts else (1.0 if server.k == 0 else None),
        draft_acceptance_rate=accepted / (drafts * server.k) if drafts else None,
        acceptance_per_position=[p / drafts for p in per_pos] if drafts else None,
        kv_cache_usage_max=max(kv, default=None),
        kv_cache_usage_mean=float(np.mean(kv)) if kv else None,
        running_max=max((g[1] for g in gauges), default=None),
        waiting_max=max((g[2] for g in gauges), default=None),
        server=dict(
            generation_tokens=delta.get("vllm:generation_tokens_total"),
            prompt_tokens=delta.get("vllm:prompt_tokens_total"),
            ttft_mean_ms=1e3 * delta.get("vllm:time_to_first_token_seconds_sum", 0.0) / ttft_count
            if ttft_count
            else None,
            drafts=drafts,
            accepted=accepted,
        ),
    )


async def warm_up(server: Server, args, grid: list[dict], tokens: np.ndarray) -> None:
    """One short request per input length and sampling mode, so nothing compiles inside a cell."""
    from openai import AsyncOpenAI

    client = AsyncOpenAI(base_url=server.url + "/v1", api_key="EMPTY", max_retries=0, timeout=args.request_timeout)
    for length, sampling in sorted({(w["input_tokens"], w["sampling"]) for w in grid}):
        await one_request(client, args.served_model_name, prompts_for(tokens, length, 1)[0], 4, SAMPLING[sampling], 0)
    await client.close()


# ----------------------------------------------------------------------------------------------
# Reports


def label(cell: dict) -> str:
    return f"in {cell['input']} / out {cell['output']} / c{cell['concurrency']} / {cell['sampling']}"


def setting(cell: dict) -> str:
    return "off" if cell["k"] == 0 else f"{cell['method']} K={cell['k']}"


def add_speedups(cells: list[dict]) -> None:
    """speedup: output tokens/s against the plain cell of the same workload."""
    base = {label(c): c["output_tok_s"] for c in cells if c["k"] == 0 and c.get("output_tok_s")}
    for c in cells:
        b = base.get(label(c))
        c["speedup"] = c["output_tok_s"] / b if b and c.get("output_tok_s") else None


def fmt(value, digits=1, suffix=""):
    return "-" if value is None else f"{value:.{digits}f}{suffix}"


def markdown(result: dict) -> str:
    env, server = result["environment"], result["server"]
    lines = [
        f"Serving benchmark, {env['device']} ({env['cpus']} CPUs), {result['date']}, jax {env['jax']}; "
        f"model {result['model']}; server max_batch {server['max_batch']}, max_length {server['max_length']}, "
        f"prefill_chunk {server['prefill_chunk']}; streamed /v1/completions over loopback, ignore_eos, "
        f"closed loop at each concurrency. TTFT, TPOT, ITL client-side (ms); tau = mean acceptance length "
        f"(/metrics deltas); KV = peak vllm:kv_cache_usage_perc; speedup = tokens/s against off.",
        "",
        "| input | output | conc | sampling | speculation | requests | TTFT mean | TTFT p50 | TTFT p99 "
        "| TPOT mean | ITL mean | tok/s | speedup | tau | acceptance per position | KV peak | errors |",
        "|---|---|---:|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|---:|---:|",
    ]
    for c in result["cells"]:
        per_pos = ", ".join(f"{p:.2f}" for p in c["acceptance_per_position"]) if c["acceptance_per_position"] else "-"
        lines.append(
            f"| {c['input_tokens']} | {c['output_tokens']} | {c['concurrency']} | {c['sampling']} | {setting(c)} "
            f"| {c['completed']}/{c['num_requests']} | {fmt(c['ttft_ms']['mean'])} | {fmt(c['ttft_ms']['p50'])} "
            f"| {fmt(c['ttft_ms']['p99'])} | {fmt(c['tpot_ms']['mean'], 2)} | {fmt(c['itl_ms']['mean'], 2)} "
            f"| {fmt(c['output_tok_s'])} | {fmt(c['speedup'], 2, 'x')} | {fmt(c['acceptance_length'], 2)} | {per_pos} "
            f"| {fmt(None if c['kv_cache_usage_max'] is None else 100 * c['kv_cache_usage_max'], 1, '%')} "
            f"| {c['num_errors']} |"
        )
    if result["skipped"]:
        lines += ["", f"Skipped (time budget or --max-cells): {len(result['skipped'])} cells."]
    return "\n".join(lines) + "\n"


def plot(result: dict, path: Path) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no plot")
        return False
    cells = result["cells"]
    labels = list(dict.fromkeys(label(c) for c in cells))
    settings = list(dict.fromkeys(setting(c) for c in cells))
    fig, axes = plt.subplots(1, 2, figsize=(max(8, 1.6 * len(labels) + 4), 4.5))
    width = 0.8 / len(settings)
    for i, s in enumerate(settings):
        by = {label(c): c for c in cells if setting(c) == s}
        xs = np.arange(len(labels)) + i * width
        axes[0].bar(xs, [by[lb]["output_tok_s"] if lb in by else 0 for lb in labels], width, label=s)
        axes[1].bar(xs, [(by[lb]["ttft_ms"]["mean"] or 0) if lb in by else 0 for lb in labels], width, label=s)
    for ax, title in zip(axes, ("output tokens/s", "TTFT mean (ms)"), strict=True):
        ax.set_xticks(np.arange(len(labels)) + 0.4 - width / 2, labels, rotation=30, ha="right", fontsize=7)
        ax.set_title(title)
    axes[0].legend(fontsize=8)
    fig.suptitle(f"Serving, {result['environment']['device']}, {result['model']}")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


# ----------------------------------------------------------------------------------------------


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="model directory (default: the bundled demo model)")
    p.add_argument("--served-model-name", default="demo")
    p.add_argument(
        "--speculative",
        nargs="+",
        default=["none", "vanilla:1", "vanilla:2", "vanilla:3"],
        help="settings: none or METHOD:K (vanilla, eagle, parallel)",
    )
    p.add_argument("--inputs", nargs="+", choices=list(INPUT_LENGTHS), default=list(INPUT_LENGTHS))
    p.add_argument("--outputs", nargs="+", choices=list(OUTPUT_LENGTHS), default=list(OUTPUT_LENGTHS))
    p.add_argument("--concurrency", nargs="+", default=["1", "4", "sat"], help="ints or sat (2 x --max-batch)")
    p.add_argument("--sampling", nargs="+", choices=list(SAMPLING), default=list(SAMPLING))
    p.add_argument("--output-short", type=int, default=OUTPUT_LENGTHS["short"], help="tokens of a short output")
    p.add_argument("--requests-per-cell", type=int, default=4, help="at least; 2 x concurrency when more")
    p.add_argument("--max-batch", type=int, default=8)
    p.add_argument("--max-length", type=int, default=1024)
    p.add_argument("--prefill-chunk", type=int, default=64)
    p.add_argument("--max-queue", type=int, default=256)
    p.add_argument("--max-cells", type=int, default=None, help="at most this many cells (workload x setting)")
    p.add_argument("--time-budget", type=float, default=3600.0, help="seconds for the whole run")
    p.add_argument("--server-timeout", type=float, default=600.0, help="seconds to wait for /health")
    p.add_argument("--request-timeout", type=float, default=600.0)
    p.add_argument(
        "--device-name", default=None, help="for the file name (default: gpu when nvidia-smi runs, else cpu)"
    )
    p.add_argument("--smoke", action="store_true", help="4 tiny cells (off and vanilla K=2) in under 2 minutes")
    p.add_argument("--out", default="benchmarks/results")
    args = p.parse_args(argv)
    if args.smoke:
        for key, value in SMOKE.items():
            setattr(args, key, value)
    for c in args.concurrency:
        if c != "sat" and not (c.isdigit() and int(c) >= 1):
            p.error(f"--concurrency: {c!r} is neither a positive int nor sat")
    args.settings = [parse_speculative(s) for s in args.speculative]
    return args


def device_name(args) -> str:
    if args.device_name:
        return args.device_name
    if shutil.which("nvidia-smi") and subprocess.run(["nvidia-smi", "-L"], capture_output=True).returncode == 0:
        return "gpu"
    return "cpu"


def main(argv=None):
    args = parse_args(argv)
    started = time.perf_counter()
    from mtp_jax.checkpoints.pretrained import DEFAULT_MODEL_DIR

    model_dir = Path(args.model or DEFAULT_MODEL_DIR)
    tokenizer = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    tokens = heldout_tokens(tokenizer)
    grid = workloads(args)
    per_setting = len(grid) if args.max_cells is None else max(0, args.max_cells // len(args.settings))
    chosen, skipped = grid[:per_setting], []
    skipped += [dict(**w, method=m, k=k, reason="max_cells") for w in grid[per_setting:] for m, k in args.settings]
    prompts = (
        {
            length: prompts_for(tokens, length, max(w["num_requests"] for w in chosen))
            for length in {w["input_tokens"] for w in chosen}
        }
        if chosen
        else {}
    )
    cells, servers = [], []
    with tempfile.TemporaryDirectory() as logs:
        for index, (method, k) in enumerate(args.settings):
            deadline = started + (args.time_budget * (index + 1)) / len(args.settings)
            if not chosen:
                break
            print(f"== speculation {method} K={k}: starting the server", flush=True)
            with Server(args, method, k, Path(logs)) as server:
                asyncio.run(warm_up(server, args, chosen, tokens))
                servers.append(dict(method=method, k=k, startup_s=server.startup_s))
                for work in chosen:
                    if time.perf_counter() > deadline:
                        skipped.append(dict(**work, method=method, k=k, reason="time_budget"))
                        continue
                    cell = asyncio.run(run_cell(server, args, work, prompts[work["input_tokens"]]))
                    cells.append(cell)
                    print(
                        f"{label(cell)} | {setting(cell)}: {fmt(cell['output_tok_s'])} tok/s, TTFT "
                        f"{fmt(cell['ttft_ms']['mean'])} ms, tau {fmt(cell['acceptance_length'], 2)}, "
                        f"{cell['num_errors']} errors",
                        flush=True,
                    )
    add_speedups(cells)
    device = device_name(args)
    result = dict(
        date=date.today().isoformat(),
        model=str(args.model or "demo (bundled)"),
        smoke=args.smoke,
        environment=dict(
            device=device,
            cpus=os.cpu_count(),
            platform=platform.platform(),
            python=platform.python_version(),
            jax=importlib.metadata.version("jax"),
        ),
        server=dict(
            max_batch=args.max_batch,
            max_length=args.max_length,
            prefill_chunk=args.prefill_chunk,
            max_queue=args.max_queue,
            servers=servers,
        ),
        grid=dict(
            inputs={n: INPUT_LENGTHS[n] for n in args.inputs},
            outputs=args.outputs,
            output_short=args.output_short,
            concurrency=args.concurrency,
            sampling=SAMPLING,
            speculative=args.speculative,
        ),
        wall_s=time.perf_counter() - started,
        cells=cells,
        skipped=skipped,
    )
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    stem = out / f"serving_{device}_{result['date']}{'_smoke' if args.smoke else ''}"
    stem.with_suffix(".json").write_text(json.dumps(result, indent=2) + "\n")
    table = markdown(result)
    stem.with_suffix(".md").write_text(table)
    print(table)
    written = [stem.with_suffix(".json"), stem.with_suffix(".md")]
    if cells and plot(result, stem.with_suffix(".png")):
        written.append(stem.with_suffix(".png"))
    print("wrote", ", ".join(map(str, written)), f"in {result['wall_s']:.0f} s")


if __name__ == "__main__":
    main()
