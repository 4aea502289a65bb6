"""Plain greedy decoding with the bundled demo model (or any model directory).

python examples/plain_decode.py --prompt "def fibonacci(n):" --max-new-tokens 48
"""

import argparse

import mtp_jax

parser = argparse.ArgumentParser()
parser.add_argument("--model", default=None, help="model directory (default: the bundled demo model)")
parser.add_argument("--prompt", default="def fibonacci(n):\n")
parser.add_argument("--max-new-tokens", type=int, default=48)
args = parser.parse_args()

model, tokenizer = mtp_jax.load_pretrained(args.model)
result = mtp_jax.generate(model, [tokenizer.encode(args.prompt).ids], max_new_tokens=args.max_new_tokens)
print(args.prompt + tokenizer.decode(result.tokens[0]))
print(f"[{result.num_generated} tokens, {result.tokens_per_second:.1f} tokens/s incl. compile]")
