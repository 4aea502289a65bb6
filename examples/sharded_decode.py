"""Plain and speculative decoding on a device mesh (jit + GSPMD), checked against one device.

    python examples/sharded_decode.py                                   # all devices on `data`
    XLA_FLAGS=--xla_force_host_platform_device_count=8 python examples/sharded_decode.py --mesh data=2,tensor=4
    XLA_FLAGS=--xla_force_host_platform_device_count=8 python examples/sharded_decode.py --model deepseek \\
        --mesh data=2,expert=4

`--mesh` names the sizes of the axes `data`, `fsdp`, `expert`, `tensor` (`mtp_jax.sharding`; one
size may be -1: the rest of the devices). The weights are placed by their logical axes, the decode
state by its rows (`data` x `fsdp`: the batch must be a multiple of their product), and
`generate(..., mesh=mesh)` runs the same jitted prefill and on-device loop as on one device. Each
configuration runs twice (the first compiles) and the second is timed; the tokens are compared with
single-device `generate` (greedy: equal up to floating-point summation order, so a near-tie can
flip a token; the script says where and exits with status 1).

`--model deepseek` decodes a random-weight DeepSeek-V3-shaped model (preset `deepseek-v3-small`:
MLA, MoE with 16 routed experts, one MTP module; random drafts are rarely accepted, so its
speculative speed is not the point here). Multi-process (one process per host, `examples/multihost.md`):
add `--coordinator-address HOST:PORT --num-processes N --process-id I` (or the `JAX_COORDINATOR_ADDRESS`,
`JAX_NUM_PROCESSES`, `JAX_PROCESS_ID` environment variables); the mesh then spans every process's
devices and process 0 prints.
"""

from __future__ import annotations

import argparse
import sys

import numpy as np

import mtp_jax
from mtp_jax.distributed import initialize_distributed
from mtp_jax.sharding import make_mesh

PROMPTS = ["def parse_args(argv):\n", "class Stack:\n", "import os\n", "    def __repr__(self):\n"]


def load(name: str):
    """The model and a function n -> n prompts (int token ids): the demo model, a random DeepSeek-V3-shaped
    one ("deepseek") or a model directory."""
    if name == "deepseek":
        config = mtp_jax.ModelConfig.from_name("deepseek-v3-small", num_nextn_predict_layers=1)
        rng = np.random.default_rng(0)
        return mtp_jax.init_model(config, seed=0), lambda n: rng.integers(1, config.vocab_size, (n, 24)).tolist()
    model, tokenizer = mtp_jax.load_pretrained(None if name == "demo" else name)
    return model, lambda n: [tokenizer.encode(PROMPTS[i % len(PROMPTS)]).ids for i in range(n)]


def first_difference(a: list[list[int]], b: list[list[int]]) -> str:
    """Where two batches of generated tokens first differ, as "row r, token t"."""
    for r, (x, y) in enumerate(zip(a, b, strict=True)):
        if x != y:
            t = next((i for i, (u, v) in enumerate(zip(x, y, strict=False)) if u != v), min(len(x), len(y)))
            return f"row {r}, token {t}"
    return "nowhere"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--mesh", default="data=-1", help="mesh axis sizes, e.g. data=2,tensor=4 (default: data=-1)")
    parser.add_argument("--model", default="demo", help="'demo' (bundled), 'deepseek' (random) or a directory")
    parser.add_argument("--batch", type=int, default=None, help="rows (default: the mesh's data x fsdp size)")
    parser.add_argument("--max-new-tokens", type=int, default=48)
    parser.add_argument("--max-length", type=int, default=256)
    parser.add_argument("--method", default="eagle", choices=["vanilla", "eagle", "parallel"])
    parser.add_argument("-k", "--num-speculative-tokens", type=int, default=2)
    parser.add_argument("--coordinator-address", default=None, help="multi-process: HOST:PORT of process 0")
    parser.add_argument("--num-processes", type=int, default=None)
    parser.add_argument("--process-id", type=int, default=None)
    args = parser.parse_args()

    initialize_distributed(args.coordinator_address, args.num_processes, args.process_id)  # before other jax calls
    import jax

    mesh = make_mesh(args.mesh)
    say = print if jax.process_index() == 0 else (lambda *a, **k: None)
    model, make_prompts = load(args.model)
    prompts = make_prompts(args.batch or mtp_jax.sharding.batch_rows(mesh))
    spec = mtp_jax.SpeculativeConfig(method=args.method, num_speculative_tokens=args.num_speculative_tokens)
    say(
        f"{args.model}: {jax.device_count()} {jax.devices()[0].platform} devices in {jax.process_count()} "
        f"process(es), mesh {dict(mesh.shape)}, batch {len(prompts)}, {args.max_new_tokens} new tokens"
    )

    if jax.devices()[0].platform == "cpu" and jax.device_count() > jax.process_count():
        say("(fake CPU devices share this machine's cores: the timings check the mechanics, not parallel speed)")
    all_equal = True
    for label, speculative in (("plain", None), (f"{args.method} K={args.num_speculative_tokens}", spec)):
        kwargs = dict(max_new_tokens=args.max_new_tokens, max_length=args.max_length, speculative=speculative)
        timed = {}
        for where, on in (("1 device", None), ("mesh", mesh)):
            mtp_jax.generate(model, prompts, mesh=on, **kwargs)  # compile
            timed[where] = mtp_jax.generate(model, prompts, mesh=on, **kwargs)
        equal = timed["mesh"].tokens == timed["1 device"].tokens
        all_equal &= equal
        metrics = timed["mesh"].metrics
        extra = "" if metrics is None else f", mean acceptance length {metrics.mean_acceptance_length:.2f}"
        say(
            f"{label:12s} 1 device {timed['1 device'].tokens_per_second:8.1f} tokens/s | mesh "
            f"{timed['mesh'].tokens_per_second:8.1f} tokens/s{extra} | same tokens as 1 device: "
            + ("yes" if equal else f"NO (first at {first_difference(timed['mesh'].tokens, timed['1 device'].tokens)})")
        )
    return 0 if all_equal else 1


if __name__ == "__main__":
    sys.exit(main())
