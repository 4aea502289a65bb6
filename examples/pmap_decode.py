"""Data-parallel speculative decoding with `jax.pmap`: one sub-batch of prompts per local device.

    python examples/pmap_decode.py --method eagle --num-speculative-tokens 3
    XLA_FLAGS=--xla_force_host_platform_device_count=8 python examples/pmap_decode.py   # 8 CPU "devices"

The prompts are split into one equal sub-batch per device of `jax.local_devices()` (the last
sub-batches padded with copies of the last prompt, dropped afterwards). Each sub-batch gets its own
`DecodeState` from the engine's `init_state`, all with the same padded prompt bucket and capacity, so
their shapes agree; the states are stacked on a leading device axis and one `pmap` runs the engine's
`prefill` and then its `run` (`step` in a `lax.while_loop`) on every device (each device loops until its own
rows are done; no collective runs). `results_from_state` reads each device's slice back.

**Prefer `jit` with shardings** (`examples/sharded_decode.py`, `DecodeEngine(model, spec, mesh=...)`,
`generate(..., mesh=...)`), which is the recommended path, for four reasons:

- pmap compiles one program per device and copies the weights whole to every device: data
  parallelism only. A mesh adds tensor parallelism (heads, FFN width, vocabulary) and expert
  parallelism (MoE experts), so a model larger than one device's memory still decodes.
- pmap needs the batch cut into per-device sub-batches by hand, as here, and every sub-batch padded
  to the same shapes; with a mesh the batch is one array whose rows GSPMD places.
- pmap sees only this process's devices; a mesh spans every process's (`examples/multihost.md`).
- JAX is phasing `pmap` out in favour of `jit` with shardings and `shard_map`
  (https://docs.jax.dev/en/latest/migrate_pmap.html).

Greedy output equals single-device `generate` token for token (`tests/multidevice/test_pmap_example.py`);
sampled rows too, since a row's random keys depend only on its seed and positions.
"""

from __future__ import annotations

import argparse
import functools
import time
from collections.abc import Sequence

import jax
import jax.numpy as jnp

import mtp_jax
from mtp_jax.decode.speculative import SpeculativeConfig
from mtp_jax.decode.state import GenerationResult, init_state, results_from_state
from mtp_jax.decode.step import prefill, run
from mtp_jax.model import Transformer, static_split


def _decode(graph, params, speculative, state, padded_prompts):
    """One device's sub-batch (state arrays [rows, ...], prompts int32 [rows, P]): prefill, then steps until
    its rows are done: the engine's `prefill` and `run`, as `DecodeEngine` jits them."""
    model = graph.merge(params)
    return run(model, speculative, prefill(model, speculative, state, padded_prompts))


@functools.cache
def _pmapped(devices: tuple[jax.Device, ...]):
    """`_decode` pmapped over `devices` (cached: one compile per devices, graph, drafter and shapes).
    The graph and drafter are static; the weights are broadcast whole to every device (in_axes None);
    the state and prompts are split along their leading axis."""
    return jax.pmap(_decode, in_axes=(None, None, None, 0, 0), static_broadcasted_argnums=(0, 2), devices=devices)


def pmap_decode(
    model: Transformer,
    prompts: Sequence[Sequence[int]],
    *,
    max_new_tokens: int = 64,
    max_length: int | None = None,
    speculative: SpeculativeConfig | None = None,
    devices: Sequence[jax.Device] | None = None,
) -> list[GenerationResult]:
    """Greedy decoding of `prompts` (B lists of int token ids), one sub-batch per device, under `jax.pmap`.

    `devices` defaults to `jax.local_devices()` (N of them); each gets ceil(B / N) rows. Returns one
    `GenerationResult` per device, in device order, whose rows are the prompts
    `prompts[d * rows : (d + 1) * rows]` (padding rows included on the last devices; `seconds` is
    the wall time of the whole pmapped call, compile included on a cold call). Raises ValueError /
    TypeError as `generate` does for an invalid request or a model that cannot serve `speculative`.
    """
    devices = list(jax.local_devices() if devices is None else devices)
    prompts = [list(p) for p in prompts]
    rows = -(-len(prompts) // len(devices))
    prompts = prompts + [prompts[-1]] * (rows * len(devices) - len(prompts))
    states, padded = zip(
        *[
            init_state(
                model,
                prompts[d * rows : (d + 1) * rows],
                max_new_tokens=max_new_tokens,
                max_length=max_length,
                speculative=speculative,
            )
            for d in range(len(devices))
        ],
        strict=True,
    )
    bucket = max(p.shape[1] for p in padded)  # the same prompt bucket on every device
    padded = jnp.stack([jnp.pad(p, ((0, 0), (0, bucket - p.shape[1]))) for p in padded])  # [N, rows, P]
    state = jax.tree.map(lambda *xs: jnp.stack(xs), *states)  # every array gets a leading axis [N, ...]
    graph, params = static_split(model)
    start = time.perf_counter()
    out = _pmapped(tuple(devices))(graph, params, speculative, state, padded)
    jax.block_until_ready(out.lengths)
    seconds = time.perf_counter() - start
    return [
        results_from_state(jax.tree.map(lambda x, d=d: x[d], out), seconds, speculating=speculative is not None)
        for d in range(len(devices))
    ]


def pmap_generate(model: Transformer, prompts: Sequence[Sequence[int]], **kwargs) -> list[list[int]]:
    """`pmap_decode`'s generated tokens, one list per prompt in prompt order (padding rows dropped);
    keyword arguments as `pmap_decode`'s."""
    results = pmap_decode(model, prompts, **kwargs)
    return [t for r in results for t in r.tokens][: len(prompts)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="model directory (default: the bundled demo model)")
    parser.add_argument("--method", default="eagle", choices=["none", "vanilla", "eagle", "parallel"])
    parser.add_argument("--num-speculative-tokens", type=int, default=3)
    parser.add_argument("--max-new-tokens", type=int, default=48)
    parser.add_argument("--rows-per-device", type=int, default=1)
    args = parser.parse_args()

    model, tokenizer = mtp_jax.load_pretrained(args.model)
    spec = (
        None
        if args.method == "none"
        else SpeculativeConfig(method=args.method, num_speculative_tokens=args.num_speculative_tokens)
    )
    starts = ["def parse_args(argv):\n", "class Stack:\n", "import os\n", "    def __repr__(self):\n"]
    texts = [starts[i % len(starts)] for i in range(args.rows_per_device * jax.local_device_count())]
    prompts = [tokenizer.encode(t).ids for t in texts]
    kwargs = dict(max_new_tokens=args.max_new_tokens, max_length=256, speculative=spec)

    pmap_decode(model, prompts, **kwargs)  # warm-up: compile
    results = pmap_decode(model, prompts, **kwargs)
    tokens = [t for r in results for t in r.tokens][: len(prompts)]
    single = mtp_jax.generate(model, prompts, **kwargs)
    generated = sum(len(t) for t in tokens)
    print(
        f"{jax.local_device_count()} devices x {args.rows_per_device} rows ({jax.devices()[0].platform}), "
        f"{args.method}: {generated} tokens in {results[0].seconds:.3f} s, {generated / results[0].seconds:.1f} "
        f"tokens/s"
    )
    print(f"identical to single-device generate: {tokens == single.tokens}")
    for text, row in list(zip(texts, tokens, strict=True))[:2]:
        print("---\n" + text + tokenizer.decode(row))
    if spec is not None:
        steps = [r.metrics.num_steps for r in results]
        lengths = [round(r.metrics.mean_acceptance_length, 2) for r in results]
        print(f"per device: verify steps {steps}, mean acceptance length {lengths}")


if __name__ == "__main__":
    main()
