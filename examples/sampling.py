"""Sampling (temperature, top-k, top-p, per-row seeds), plain and speculative (lossless rejection sampling).

python examples/sampling.py --temperature 0.8 --top-p 0.95
"""

import argparse

import mtp_jax

parser = argparse.ArgumentParser()
parser.add_argument("--model", default=None)
parser.add_argument("--prompt", default="import ")
parser.add_argument("--temperature", type=float, default=0.8)
parser.add_argument("--top-k", type=int, default=0)
parser.add_argument("--top-p", type=float, default=0.95)
parser.add_argument("--rows", type=int, default=3, help="rows, each with its own seed")
parser.add_argument("--max-new-tokens", type=int, default=40)
args = parser.parse_args()

model, tokenizer = mtp_jax.load_pretrained(args.model)
prompts = [tokenizer.encode(args.prompt).ids] * args.rows
sampling = [
    mtp_jax.SamplingParams(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, seed=seed)
    for seed in range(args.rows)
]
spec = mtp_jax.SpeculativeConfig(method="eagle", num_speculative_tokens=2)
result = mtp_jax.generate(model, prompts, max_new_tokens=args.max_new_tokens, sampling=sampling, speculative=spec)
for row, tokens in enumerate(result.tokens):
    print(f"--- seed {row}\n{args.prompt}{tokenizer.decode(tokens)}")
print(result.metrics.summary())
