"""Evaluates a finished training run's export and writes it, with a model card, into a model directory.

    python scripts/model_card.py runs/demo [--heads runs/demo-heads] --out mtp_jax/assets/demo [--overwrite]

The card records the training command, corpus (Python version, files, tokens), training time,
held-out main loss (nats/token and bits/byte) and each MTP depth's loss, top-1 agreement with the
main model and simulated acceptance; `mtp-jax eval mtp_jax/assets/demo` reproduces the held-out numbers.
With --heads, the weights are that run's export (the MTP heads fine-tuned on the model's own
generations, `mtp-jax distill-data` + `mtp-jax train --mtp-only --mtp-targets self --data`), and the card
says how they were made.
"""

import argparse
import json
import shutil
import sys
from datetime import UTC, datetime
from pathlib import Path

import jax

from mtp_jax.checkpoints.pretrained import load_pretrained
from mtp_jax.training import data
from mtp_jax.training.trainer import evaluate

COMMAND = "bash scripts/build_demo_model.sh"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("run_dir")
    parser.add_argument("--heads", help="the self-distilled MTP-heads run started from RUN_DIR's export")
    parser.add_argument("--out", required=True)
    parser.add_argument("--overwrite", action="store_true", help="replace the model files in --out")
    args = parser.parse_args()
    run_dir, out = Path(args.run_dir), Path(args.out)
    export = Path(args.heads or run_dir) / "export"
    run = json.loads((run_dir / "run.json").read_text())
    log = [json.loads(line) for line in (run_dir / "log.jsonl").read_text().splitlines()]
    model, tokenizer = load_pretrained(export)
    corpus = data.prepare_corpus(
        run["corpus"]["work_dir"],
        vocab_size=run["corpus"]["vocab_size"],
        heldout_fraction=run["corpus"]["heldout_fraction"],
    )
    seq_len = run["train_config"]["seq_len"]
    heldout = evaluate(model, corpus.heldout, data.token_byte_lengths(corpus.tokenizer), batch_size=16, seq_len=seq_len)
    train_hours = _hours(run_dir)
    params = sum(x.size for x in jax.tree.leaves(model))
    c, t, meta = model.config, run["train_config"], corpus.metadata
    steps = max(r["step"] for r in log if r["kind"] == "train")
    depths = range(1, c.num_nextn_predict_layers + 1)
    rows = "\n".join(
        f"| {k} | {heldout[f'mtp_loss_{k}']:.3f} | {heldout[f'mtp_agreement_{k}']:.1%} | "
        f"{heldout[f'mtp_acceptance_{k}']:.1%} | {heldout[f'mtp_acceptance_length_{k}']:.2f} |"
        for k in depths
    )
    card = f"""# mtp_jax demo model

A small Llama-style decoder with {c.num_nextn_predict_layers} DeepSeek-V3-style MTP modules, trained from scratch
with the MTP objective on the Python standard library's source. It exists to exercise and
measure MTP speculative decoding on a CPU; it writes Python-looking code but is far too small to
write correct programs, and greedy continuations soon fall into repetition loops.

- Architecture: {c.num_hidden_layers} layers, width {c.hidden_size}, {c.num_attention_heads} heads of \
{c.resolved_head_dim}, SwiGLU {c.intermediate_size}, RoPE, untied head, vocabulary {c.vocab_size} (byte-level BPE);
  {c.num_nextn_predict_layers} MTP modules (`enorm`, `hnorm`, `eh_proj`, one block, `shared_head.norm`), sharing
  the embedding and the output head. {params / 1e6:.2f}M parameters, float32.
- Corpus: CPython {meta["python_version"].split()[0]} standard library `*.py` files (tests, generated tables and
  `pydoc_data` excluded), split by file: {meta["num_train_files"]} train files \
({meta["num_train_tokens"]:,} tokens), {meta["num_heldout_files"]} held-out files \
({meta["num_heldout_tokens"]:,} tokens).
- Training: {steps} steps of {t["batch_size"]} x {t["seq_len"]} tokens ({steps * t["batch_size"] * t["seq_len"]:,} \
tokens), AdamW lr {t["learning_rate"]} (warm-up {t["warmup_steps"]}, cosine to {t["min_lr_ratio"]}x), weight decay \
{t["weight_decay"]}, clip {t["grad_clip_norm"]}, MTP weight lambda {t["mtp_lambda"]}; {train_hours:.2f} hours on \
2 CPU cores.
- Regenerate: `{COMMAND}` (then `mtp-jax eval mtp_jax/assets/demo` prints the numbers below).

## Held-out evaluation

Main model: **{heldout["main_loss"]:.3f} nats/token, {heldout["bits_per_byte"]:.3f} bits/byte** over \
{int(heldout["num_tokens"]):,} tokens.

| MTP depth k | loss (nats/token, of t+k+1) | agreement with main argmax | simulated acceptance | simulated tau |
|---:|---:|---:|---:|---:|
{rows}

Agreement and simulated acceptance are teacher-forced (each depth sees the true tokens); they
approximate the per-position acceptance of strict-greedy speculative decoding with MTP Vanilla.
{_heads_section(Path(args.heads)) if args.heads else ""}"""
    if out.exists() and any(out.iterdir()) and not args.overwrite:
        sys.exit(f"{out} is not empty; pass --overwrite to replace the model there")
    out.mkdir(parents=True, exist_ok=True)
    for name in ("config.json", "model.safetensors", "tokenizer.json"):
        shutil.copyfile(export / name, out / name)
    (out / "README.md").write_text(card)
    (out / "eval.json").write_text(
        json.dumps(
            {
                "heldout": heldout,
                "python_version": meta["python_version"],
                "date": datetime.now(UTC).date().isoformat(),
            },
            indent=1,
        )
        + "\n"
    )
    print(card)


def _hours(run_dir: Path) -> float:
    """Wall time of a run, from its run.json to its export."""
    return ((run_dir / "export" / "config.json").stat().st_mtime - (run_dir / "run.json").stat().st_mtime) / 3600


def _heads_section(heads: Path) -> str:
    """The card's account of the self-distilled heads: the data, the training, the held-out gain."""
    run = json.loads((heads / "run.json").read_text())
    t = run["train_config"]
    distilled = json.loads((Path(run["corpus"]["work_dir"]) / "corpus.json").read_text())
    d = distilled["settings"]
    evals = [json.loads(line) for line in (heads / "log.jsonl").read_text().splitlines()]
    last = [r for r in evals if r["kind"] == "eval"][-1]
    return f"""
## Self-distilled MTP heads

The MTP modules were then fine-tuned on the model's own greedy continuations, the trunk frozen (its
tensors byte-identical): `mtp-jax distill-data` ({d["num_samples"]:,} train + {d["heldout_samples"]}
held-out samples: {d["prompt_len"]}-token windows of the train files, {d["max_new_tokens"]} greedy tokens each,
{distilled["num_train_tokens"]:,} tokens), then `mtp-jax train --mtp-only --mtp-targets self --data` for
{t["num_steps"]} steps of {t["batch_size"]} x {t["seq_len"]} tokens, AdamW lr {t["learning_rate"]} (warm-up
{t["warmup_steps"]}), {_hours(heads):.2f} hours on 2 CPU cores (see `scripts/build_demo_model.sh`). On the
held-out samples (the model's own continuations of held-out windows) the simulated mean acceptance length
at K = 3 is {last["mtp_acceptance_length_3"]:.2f} (MTP Vanilla) and {last["eagle_acceptance_length_3"]:.2f}
(MTP Eagle); live figures before and after: `benchmarks/bench_self_distill.py`, docs/benchmarks.md.
"""


if __name__ == "__main__":
    main()
