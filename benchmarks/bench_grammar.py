"""Structured-output grammar engines on the host: llguidance (what `mtp_jax.serving.grammar` uses) against xgrammar.

For one tokenizer (default: the demo's, V = 4096) and a JSON schema with nested objects, an enum, arrays and
numbers, each engine runs in its own Python process (clean import time and memory) and reports:

- `import_s` and `import_rss_mb` (the engine's module alone), `tokenizer_s` and `tokenizer_rss_mb` (its
  tokenizer info from tokenizer.json, no transformers), `compile_ms` (the schema, cold, median of --compiles
  distinct variants; `compile_first_ms` the first), `json_object_ms`, `matcher_us` (a request's matcher from a
  compiled grammar) and `kb_per_grammar` (resident memory per compiled grammar over the variants);
- per decode step of one row, walking the tokens of a valid document position by position: `fill_masks` with
  K = 0 and K = 3 drafts (the next document tokens: every draft valid, the most work: K+1 masks, K advances,
  one rollback of K), `accept` of one token, and `rollback` of 3 tokens, in microseconds (median and p90).

llguidance is driven through `GrammarMatcher` (the module's Python bookkeeping included); xgrammar through an
equivalent few lines (`GrammarMatcher.fill_next_token_bitmask` / `accept_token` / `rollback`). xgrammar needs
torch and transformers importable; an engine that is not installed is skipped. The CPU is shared with whatever
else runs: compare within one run. Writes grammar_cpu_<date>[_<tag>].json and .md under --out.

    python benchmarks/bench_grammar.py [--engines llguidance xgrammar] [--tokenizer PATH] [--vocab-size V] [--tag T]
    python benchmarks/bench_grammar.py --train-bpe 32000   # a 32k byte-level BPE trained on the stdlib instead
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from datetime import date
from pathlib import Path

import numpy as np
from report import cpu_name  # this directory is on sys.path when run as a script

ROOT = Path(__file__).resolve().parents[1]
DEMO_TOKENIZER = ROOT / "mtp_jax" / "assets" / "demo" / "tokenizer.json"
ENGINES = ("llguidance", "xgrammar")
KS = (0, 3)

SCHEMA = {
    "type": "object",
    "properties": {
        "id": {"type": "integer"},
        "title": {"type": "string"},
        "status": {"enum": ["draft", "review", "published", "archived"]},
        "rating": {"type": "number", "minimum": 0, "maximum": 5},
        "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 8},
        "author": {
            "type": "object",
            "properties": {
                "name": {"type": "string"},
                "email": {"type": "string"},
                "roles": {"type": "array", "items": {"enum": ["admin", "editor", "viewer"]}},
            },
            "required": ["name", "roles"],
            "additionalProperties": False,
        },
        "sections": {
            "type": "array",
            "items": {
                "type": "object",
                "properties": {
                    "heading": {"type": "string"},
                    "words": {"type": "integer"},
                    "scores": {"type": "array", "items": {"type": "number"}},
                },
                "required": ["heading", "words"],
                "additionalProperties": False,
            },
        },
    },
    "required": ["id", "title", "status", "rating", "tags", "author", "sections"],
    "additionalProperties": False,
}
DOCUMENT = {
    "id": 4021,
    "title": "Speculative decoding with grammars",
    "status": "review",
    "rating": 4.25,
    "tags": ["mtp", "json", "decoding"],
    "author": {"name": "Ada Lovelace", "email": "ada@example.org", "roles": ["editor", "viewer"]},
    "sections": [
        {"heading": "Introduction", "words": 512, "scores": [0.5, 1.75]},
        {"heading": "Masks per verify position", "words": 1280, "scores": []},
    ],
}


def variant(i: int) -> dict:
    """The schema with a distinct enum: a cold compile each (no engine cache can serve it)."""
    schema = json.loads(json.dumps(SCHEMA))
    schema["properties"]["status"]["enum"] = [f"{name}{i}" for name in ("draft", "review", "published", "archived")]
    return schema


def rss_mb() -> float:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS")) / 1024


class XgrammarEngine:
    """The same operations as `mtp_jax.serving.grammar` on xgrammar 0.2.x (for the comparison only)."""

    def __init__(self, tokenizer, vocab_size: int, stop: list[int]):
        import xgrammar

        self.xgr = xgrammar
        size = tokenizer.get_vocab_size(with_added_tokens=True)
        meta = xgrammar.TokenizerInfo._detect_metadata_from_hf(tokenizer.to_str())
        vocab = [tokenizer.id_to_token(i) for i in range(size)]
        info = xgrammar.TokenizerInfo(
            vocab,
            meta["vocab_type"],
            vocab_size=vocab_size,
            stop_token_ids=stop,
            add_prefix_space=meta["add_prefix_space"],
        )
        self.compiler = xgrammar.GrammarCompiler(info, max_threads=1, cache_enabled=False)

    def compile_json_schema(self, schema):
        return self.compiler.compile_json_schema(json.dumps(schema))

    def compile_json_object(self):
        return self.compiler.compile_builtin_json_grammar()

    def matcher(self, compiled):
        return XgrammarMatcher(self.xgr.GrammarMatcher(compiled))


class XgrammarMatcher:
    def __init__(self, matcher):
        self.m = matcher

    def accept(self, tokens):
        for i, token in enumerate(tokens):
            if not self.m.accept_token(token):
                return i
        return len(tokens)

    def rollback(self, n):
        self.m.rollback(n)

    def fill_masks(self, drafts, out):
        self.m.fill_next_token_bitmask(out, 0)
        advanced = 0
        for j, token in enumerate(drafts, start=1):
            if not self.m.accept_token(token):
                out[j:] = -1
                break
            advanced += 1
            self.m.fill_next_token_bitmask(out, j)
        if advanced:
            self.m.rollback(advanced)
        return advanced


class LlguidanceEngine:
    def __init__(self, tokenizer, vocab_size: int, stop: list[int]):
        from mtp_jax.serving.grammar import GrammarCompiler

        self.compiler = GrammarCompiler(tokenizer, vocab_size, stop, cache_size=1024)

    def compile_json_schema(self, schema):
        return self.compiler.compile_json_schema(schema)

    def compile_json_object(self):
        return self.compiler.compile({"type": "json_object"})

    def matcher(self, compiled):
        return compiled.matcher()


def median_us(times: list[float]) -> float:
    return float(np.median(times) * 1e6)


def p90_us(times: list[float]) -> float:
    return float(np.percentile(times, 90) * 1e6)


def child(engine: str, args) -> dict:
    """One engine's measurements, in this (fresh) process."""
    from tokenizers import Tokenizer

    base = rss_mb()
    begin = time.perf_counter()
    if engine == "xgrammar":
        import xgrammar  # noqa: F401  (torch and transformers come with it)
    else:
        import llguidance  # noqa: F401
    import_s = time.perf_counter() - begin
    after_import = rss_mb()
    if engine == "llguidance":
        import mtp_jax.serving.grammar  # noqa: F401  (jax and the rest of the package: not the engine's cost)
    before_tokenizer = rss_mb()
    tokenizer = Tokenizer.from_file(str(args.tokenizer))
    vocab_size = args.vocab_size or tokenizer.get_vocab_size(with_added_tokens=True)
    begin = time.perf_counter()
    eng = (XgrammarEngine if engine == "xgrammar" else LlguidanceEngine)(tokenizer, vocab_size, [args.eos])
    tokenizer_s = time.perf_counter() - begin
    after_tokenizer = rss_mb()

    compile_times, keep = [], []
    for i in range(args.compiles):
        begin = time.perf_counter()
        keep.append(eng.compile_json_schema(variant(i)))
        compile_times.append(time.perf_counter() - begin)
    kb_per_grammar = (rss_mb() - after_tokenizer) * 1024 / args.compiles
    begin = time.perf_counter()
    eng.compile_json_object()
    json_object_ms = (time.perf_counter() - begin) * 1e3

    grammar = eng.compile_json_schema(SCHEMA)
    matcher_times = []
    for _ in range(200):
        begin = time.perf_counter()
        eng.matcher(grammar)
        matcher_times.append(time.perf_counter() - begin)

    tokens = tokenizer.encode(json.dumps(DOCUMENT)).ids
    words = (vocab_size + 31) // 32
    step = {f"fill_masks_k{k}": [] for k in KS} | {"accept": [], "rollback3": []}
    for _ in range(args.repeats):
        for k in KS:  # a walk per K: each position's first mask is computed by the call being timed
            matcher = eng.matcher(grammar)
            for i, token in enumerate(tokens):
                drafts = tokens[i : i + k]  # the next document tokens: all valid
                out = np.empty((len(drafts) + 1, words), np.int32)
                begin = time.perf_counter()
                assert matcher.fill_masks(drafts, out) == len(drafts)
                step[f"fill_masks_k{k}"].append(time.perf_counter() - begin)
                begin = time.perf_counter()
                assert matcher.accept([token]) == 1
                step["accept"].append(time.perf_counter() - begin)
        matcher = eng.matcher(grammar)
        assert matcher.accept(tokens[:3]) == 3
        for i in range(3, len(tokens)):
            assert matcher.accept([tokens[i]]) == 1
            begin = time.perf_counter()
            matcher.rollback(3)
            step["rollback3"].append(time.perf_counter() - begin)
            assert matcher.accept(tokens[i - 2 : i + 1]) == 3
    version = __import__(engine).__version__ if engine == "llguidance" else _xgrammar_version()
    row = dict(
        engine=engine,
        version=version,
        vocab_size=vocab_size,
        document_tokens=len(tokens),
        import_s=import_s,
        import_rss_mb=after_import - base,
        tokenizer_s=tokenizer_s,
        tokenizer_rss_mb=after_tokenizer - before_tokenizer,
        compile_ms=float(np.median(compile_times) * 1e3),
        compile_first_ms=compile_times[0] * 1e3,
        json_object_ms=json_object_ms,
        kb_per_grammar=kb_per_grammar,
        matcher_us=median_us(matcher_times),
    )
    for name, times in step.items():
        row[f"{name}_us"], row[f"{name}_p90_us"] = median_us(times), p90_us(times)
    return row


def _xgrammar_version() -> str:
    from importlib.metadata import version

    return version("xgrammar")


def markdown(meta: dict, rows: list[dict]) -> str:
    lines = [f"# Grammar engines on the host, {meta['date']}", ""]
    lines.append(f"{meta['cpu']} ({meta['cores']} cores, shared); tokenizer {meta['tokenizer']}.")
    if rows:
        lines.append(
            f"V = {rows[0]['vocab_size']}; JSON schema with nested objects, enums, arrays and numbers; "
            f"a document of {rows[0]['document_tokens']} tokens."
        )
    lines += [
        "",
        "| engine | import s | import RSS MB | tokenizer ms | compile ms (first) | json_object ms | matcher us "
        "| KB/grammar | fill_masks K=0 us (p90) | fill_masks K=3 us (p90) | accept us | rollback 3 us |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(
            f"| {r['engine']} {r['version']} | {r['import_s']:.2f} | {r['import_rss_mb']:.0f} "
            f"| {r['tokenizer_s'] * 1e3:.1f} | {r['compile_ms']:.2f} ({r['compile_first_ms']:.2f}) "
            f"| {r['json_object_ms']:.2f} | {r['matcher_us']:.1f} | {r['kb_per_grammar']:.0f} "
            f"| {r['fill_masks_k0_us']:.1f} ({r['fill_masks_k0_p90_us']:.1f}) "
            f"| {r['fill_masks_k3_us']:.1f} ({r['fill_masks_k3_p90_us']:.1f}) | {r['accept_us']:.2f} "
            f"| {r['rollback3_us']:.2f} |"
        )
    for name, why in meta["skipped"].items():
        lines.append(f"\n{name}: skipped ({why})")
    lines.append("\nPer-step times: medians (p90) over every document position and --repeats walks, one row.")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--engines", nargs="+", default=list(ENGINES), choices=ENGINES)
    parser.add_argument("--tokenizer", type=Path, default=DEMO_TOKENIZER)
    parser.add_argument("--vocab-size", type=int, default=None, help="the model's V (default: the tokenizer's size)")
    parser.add_argument("--eos", type=int, default=0, help="the stop token id (the demo's EOS: 0)")
    parser.add_argument("--compiles", type=int, default=20, help="distinct schema variants compiled cold")
    parser.add_argument("--repeats", type=int, default=20, help="walks through the document")
    parser.add_argument(
        "--train-bpe", type=int, default=0, metavar="N", help="instead: a byte-level BPE of N ids trained here"
    )
    parser.add_argument("--tag", default="", help="suffix of the results' name (e.g. the tokenizer's)")
    parser.add_argument("--out", default="benchmarks/results")
    parser.add_argument("--child", choices=ENGINES, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(child(args.child, args)))
        return

    if args.train_bpe:
        args.tokenizer = train_bpe(args.train_bpe, Path(tempfile.mkdtemp()) / f"bpe{args.train_bpe}.json")
        args.tag = args.tag or f"bpe{args.train_bpe // 1000}k"
    rows, skipped = [], {}
    for engine in args.engines:
        forwarded = ["--tokenizer", str(args.tokenizer), "--eos", str(args.eos)]
        forwarded += ["--compiles", str(args.compiles), "--repeats", str(args.repeats)]
        forwarded += ["--vocab-size", str(args.vocab_size)] if args.vocab_size else []
        done = subprocess.run(
            [sys.executable, __file__, "--child", engine, *forwarded], capture_output=True, text=True, cwd=ROOT
        )
        if done.returncode:
            tail = done.stderr.strip().splitlines()
            skipped[engine] = tail[-1] if tail else f"exit {done.returncode}"
            print(f"{engine}: skipped ({skipped[engine]})", flush=True)
            continue
        rows.append(json.loads(done.stdout.strip().splitlines()[-1]))
    meta = dict(
        benchmark="grammar",
        date=str(date.today()),
        cpu=cpu_name(),
        cores=os.cpu_count(),
        platform=platform.platform(),
        python=platform.python_version(),
        tokenizer=f"a byte-level BPE of {args.train_bpe} ids trained on the Python stdlib (--train-bpe)"
        if args.train_bpe
        else str(args.tokenizer.relative_to(ROOT) if args.tokenizer.is_relative_to(ROOT) else args.tokenizer),
        skipped=skipped,
        args={k: str(v) for k, v in vars(args).items() if k not in ("out", "child")},
    )
    sys.path.insert(0, str(Path(__file__).parent))
    from report import write_report

    write_report(
        args.out, f"grammar_cpu_{meta['date']}" + (f"_{args.tag}" if args.tag else ""), meta, rows, markdown(meta, rows)
    )


def train_bpe(size: int, path: Path) -> Path:
    """A byte-level BPE of `size` ids (id 0 "<|endoftext|>") trained on this Python's standard library (~10 s):
    a larger vocabulary than the demo's, with the same kind of tokens."""
    import sysconfig

    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    stdlib = Path(sysconfig.get_paths()["stdlib"])
    files = [str(f) for f in sorted(stdlib.rglob("*.py")) if "test" not in f.parts and "site-packages" not in f.parts]
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    trainer = trainers.BpeTrainer(
        vocab_size=size, special_tokens=["<|endoftext|>"], initial_alphabet=alphabet, show_progress=False
    )
    tokenizer.train(files, trainer)
    path.parent.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(path))
    return path


if __name__ == "__main__":
    main()
