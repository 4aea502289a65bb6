"""Streaming: print tokens as each speculative step commits them (one to K+1 tokens per step).

    python examples/streaming.py                                  # the default prompt: "class Stack:" and a newline
    python examples/streaming.py --prompt $'def parse(text):\n'    # bash / zsh: $'...' makes \n a newline

(In double quotes the shell passes `\n` on as a backslash and an n, which the model sees as such.)
"""

import argparse
import sys

import mtp_jax

parser = argparse.ArgumentParser()
parser.add_argument("--model", default=None)
parser.add_argument("--prompt", default="class Stack:\n")
parser.add_argument("--max-new-tokens", type=int, default=80)
args = parser.parse_args()

model, tokenizer = mtp_jax.load_pretrained(args.model)
spec = mtp_jax.SpeculativeConfig(method="eagle", num_speculative_tokens=3)
sys.stdout.write(args.prompt)
for piece in mtp_jax.stream_text(model, tokenizer, args.prompt, max_new_tokens=args.max_new_tokens, speculative=spec):
    sys.stdout.write(piece)
    sys.stdout.flush()
print()
