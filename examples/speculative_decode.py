"""MTP speculative decoding, checked against plain greedy decoding, with the acceptance metrics.

python examples/speculative_decode.py --method eagle --num-speculative-tokens 3
"""

import argparse

import mtp_jax

parser = argparse.ArgumentParser()
parser.add_argument("--model", default=None, help="model directory (default: the bundled demo model)")
parser.add_argument("--prompt", default="    def __repr__(self):\n")
parser.add_argument("--method", default="eagle", choices=["vanilla", "eagle", "parallel"])
parser.add_argument("--num-speculative-tokens", type=int, default=3)
parser.add_argument("--max-new-tokens", type=int, default=64)
args = parser.parse_args()

model, tokenizer = mtp_jax.load_pretrained(args.model)
prompts = [tokenizer.encode(args.prompt).ids]
spec = mtp_jax.SpeculativeConfig(method=args.method, num_speculative_tokens=args.num_speculative_tokens)
fast = mtp_jax.generate(model, prompts, max_new_tokens=args.max_new_tokens, speculative=spec)
plain = mtp_jax.generate(model, prompts, max_new_tokens=args.max_new_tokens)
print(args.prompt + tokenizer.decode(fast.tokens[0]))
print(f"identical to plain greedy: {fast.tokens == plain.tokens}")
m = fast.metrics
print(f"mean acceptance length {m.mean_acceptance_length:.2f} ({m.num_steps} verify steps)")
print("per-position acceptance:", [round(r, 3) for r in m.acceptance_rate_per_position])
print("accepted-length histogram:", m.accepted_length_histogram)
