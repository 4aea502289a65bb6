"""Continuous batching with MTP speculation, in process: requests arrive while others decode.

    python examples/serving.py [--speculative eagle] [--num-speculative-tokens 3] [--max-batch 2]

Prints, per engine step, how many tokens each running request committed (1 .. K+1), then each
request's text and metrics, and checks that every greedy request got exactly what
`mtp_jax.decode.generation` gives it alone. Over HTTP the same engine serves OpenAI's API:

    mtp-jax serve --speculative eagle --num-speculative-tokens 3 --max-batch 8 --port 8000

    from openai import OpenAI
    client = OpenAI(base_url="http://127.0.0.1:8000/v1", api_key="unused")
    client.completions.create(model="demo", prompt="import os\\n", max_tokens=64, temperature=0)
"""

import argparse

import mtp_jax
from mtp_jax.serving import ServingEngine

PROMPTS = ["import os\n", "class Stack:\n    def __init__(self", "def parse_args(argv):\n", "x = ["]


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--speculative", default="eagle", choices=["none", "eagle", "vanilla"])
    parser.add_argument("--num-speculative-tokens", type=int, default=3)
    parser.add_argument("--max-batch", type=int, default=2, help="slots (fewer than the requests: some wait)")
    parser.add_argument("--max-tokens", type=int, default=32)
    args = parser.parse_args(argv)

    model, tokenizer = mtp_jax.load_pretrained()
    spec = (
        None
        if args.speculative == "none"
        else mtp_jax.SpeculativeConfig(method=args.speculative, num_speculative_tokens=args.num_speculative_tokens)
    )
    engine = ServingEngine(model, spec, tokenizer=tokenizer, max_batch=args.max_batch, max_length=256, prefill_chunk=32)
    engine.warm_up()

    ids, texts, tokens, last = {}, {}, {}, {}
    step = 0
    while step == 0 or engine.has_unfinished():
        if step < len(PROMPTS):  # one new request per step
            rid = engine.add_request(tokenizer.encode(PROMPTS[step]).ids, max_tokens=args.max_tokens)
            ids[rid] = PROMPTS[step]
        outputs = engine.step()
        for out in outputs:
            texts[out.request_id] = texts.get(out.request_id, "") + out.text
            tokens.setdefault(out.request_id, []).extend(out.token_ids)
            last[out.request_id] = out
        print(f"step {step:3d}: " + ", ".join(f"{o.request_id} +{o.num_committed}" for o in outputs))
        step += 1

    for rid, prompt in ids.items():
        m = last[rid].metrics
        print(
            f"\n{rid} ({last[rid].finish_reason}, {len(tokens[rid])} tokens, TTFT {m.ttft * 1e3:.1f} ms, "
            f"mean acceptance length {m.mean_acceptance_length:.2f}):\n{prompt}{texts[rid]}"
        )
        alone = mtp_jax.generate(
            model, [tokenizer.encode(prompt).ids], max_new_tokens=args.max_tokens, max_length=256, speculative=spec
        ).tokens[0]
        assert tokens[rid] == alone, f"{rid}: served tokens differ from generate alone"
    print("\nevery request got exactly what generate gives it alone")


if __name__ == "__main__":
    main()
