"""The `mtp-jax` command line: generate, train, eval."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from mtp_jax.pretrained import DEFAULT_MODEL_DIR as DEFAULT_MODEL


def add_generate_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser("generate", help="generate text from prompts with a model directory",
                              description="Generate continuations of text prompts. The model directory holds "
                                          "config.json, safetensors weights and tokenizer.json (Hugging Face layout).")
    p.add_argument("--model", default=str(DEFAULT_MODEL), help="model directory (default: the bundled demo model)")
    p.add_argument("--prompt", action="append", help="a prompt (repeat for a batch)")
    p.add_argument("--prompt-file", action="append", help="a file whose whole text is one prompt (repeatable)")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--max-length", type=int, default=None,
                   help="cache capacity in tokens, prompt included (default: the model's max positions)")
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    p.add_argument("--top-k", type=int, default=0, help="0 = off")
    p.add_argument("--top-p", type=float, default=1.0, help="1 = off")
    p.add_argument("--seed", type=int, default=0, help="seed of the first row; row b uses seed + b")
    p.add_argument("--speculative", default="none", choices=["none", "vanilla", "eagle", "parallel"],
                   help="MTP speculative decoding method (default: none, plain decoding)")
    p.add_argument("--num-speculative-tokens", type=int, default=None,
                   help="K, drafts per step (default: the model's MTP modules, for eagle 3)")
    p.add_argument("--stream", action="store_true", help="print tokens as they are committed (batch of one)")
    p.set_defaults(func=run_generate)
    return p


def _prompts(args) -> list[str]:
    texts = list(args.prompt or [])
    for path in args.prompt_file or []:
        texts.append(Path(path).read_text(encoding="utf-8"))
    if not texts:
        texts = ["import os\n\n\ndef "]
    return texts


def run_generate(args) -> int:
    from mtp_jax.generate import generate, stream
    from mtp_jax.pretrained import load_pretrained
    from mtp_jax.sampling import SamplingParams

    model, tokenizer = load_pretrained(args.model)
    texts = _prompts(args)
    prompts = [tokenizer.encode(t).ids for t in texts]
    sampling = [SamplingParams(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, seed=args.seed + b)
                for b in range(len(prompts))]
    speculative = None
    if args.speculative != "none":
        from mtp_jax.speculative import SpeculativeConfig

        k = args.num_speculative_tokens
        if k is None:
            k = 3 if args.speculative == "eagle" else max(model.config.num_nextn_predict_layers, 1)
        speculative = SpeculativeConfig(method=args.speculative, num_speculative_tokens=k)
    kwargs = dict(max_new_tokens=args.max_new_tokens, sampling=sampling, max_length=args.max_length,
                  speculative=speculative)
    if args.stream:
        if len(prompts) != 1:
            raise ValueError("--stream takes exactly one prompt")
        sys.stdout.write(texts[0])
        emitted: list[int] = []
        shown = ""
        for step in stream(model, prompts, **kwargs):
            emitted += step[0]
            text = tokenizer.decode(emitted)
            sys.stdout.write(text[len(shown):])
            sys.stdout.flush()
            shown = text
        print()
        return 0
    result = generate(model, prompts, **kwargs)
    for b, (text, tokens) in enumerate(zip(texts, result.tokens, strict=True)):
        print(f"=== prompt {b} ({len(prompts[b])} tokens) -> {len(tokens)} tokens, {result.finish_reasons[b]}")
        print(text + tokenizer.decode(tokens))
    print(f"--- {result.num_generated} tokens in {result.seconds:.2f} s (compile included): "
          f"{result.tokens_per_second:.1f} tokens/s", file=sys.stderr)
    if speculative is not None:
        print(f"--- {args.speculative}, K = {speculative.num_speculative_tokens}: {result.metrics.summary()}",
              file=sys.stderr)
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="mtp-jax", description="Multi-Token Prediction models in JAX.")
    subparsers = parser.add_subparsers(dest="command", required=True)
    add_generate_parser(subparsers)
    from mtp_jax.train import add_eval_parser, add_train_parser

    add_train_parser(subparsers)
    add_eval_parser(subparsers)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except (ValueError, FileNotFoundError, FileExistsError) as error:
        print(f"mtp-jax {args.command}: error: {error}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
