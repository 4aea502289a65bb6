"""One process of `tests/test_memory_plan.py`'s lowering tests: the engine's jitted decode step and prefill
of a full-size preset, lowered and compiled (never run) on a mesh of fake CPU devices from abstract
weights and an abstract decode state (`jax.ShapeDtypeStruct`s carrying the engine's `NamedSharding`s);
prints one JSON object: the plan's per-device bytes and each program's `memory_analysis()`.

    python tests/lowering_worker.py PRESET MESH [--dtype float32] [--step-only]

The environment sets the devices (`JAX_PLATFORMS=cpu`, `XLA_FLAGS=--xla_force_host_platform_device_count=8`).
Decoding: batch 8 x 4096 tokens, eagle K = 1 (the presets have one MTP module).
"""

import argparse
import json
import time

BATCH, LENGTH, K = 8, 4096, 1


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("preset")
    parser.add_argument("mesh")
    parser.add_argument("--dtype", default=None)
    parser.add_argument("--step-only", action="store_true")
    args = parser.parse_args()
    start = time.perf_counter()

    import jax
    from jax.sharding import PartitionSpec as P

    from mtp_jax.config import PRESETS
    from mtp_jax.decode import engine
    from mtp_jax.decode.speculative import SpeculativeConfig
    from mtp_jax.memory_plan import abstract_decode_state, abstract_model, memory_plan
    from mtp_jax.model import static_split
    from mtp_jax.sharding import make_mesh, named_shardings, param_logical_axes

    config = PRESETS[args.preset]
    if args.dtype:
        config = config.replace(dtype=args.dtype, param_dtype=args.dtype)
    speculative = SpeculativeConfig(method="eagle", num_speculative_tokens=K)
    mesh = make_mesh(args.mesh)
    plan = memory_plan(config, mesh, max_batch=BATCH, max_length=LENGTH, speculative=speculative, device_memory_bytes=1)

    def placed(tree, logical):  # ShapeDtypeStructs on the shardings the engine places them on
        shardings = named_shardings(tree, logical, mesh)
        return jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), tree, shardings)

    model = abstract_model(config)
    graph, params = static_split(model)  # what DecodeEngine passes its jitted calls
    state, padded = abstract_decode_state(model, max_batch=BATCH, max_length=LENGTH, speculative=speculative)
    params, state, padded = (
        placed(params, param_logical_axes(params)),
        placed(state, state.logical_axes()),
        placed(padded, P("batch", None)),
    )
    out = {
        "plan": {
            "weights": sum(plan.weights_bytes.values()),
            "state": plan.kv_cache_bytes + plan.mtp_cache_bytes + plan.decode_state_bytes,
            "padded": padded.size * padded.dtype.itemsize // plan.mesh["data"] // plan.mesh["fsdp"],
        },
        "setup_s": time.perf_counter() - start,
    }
    programs = {"step": (engine._step_jit, (graph, params, speculative, state), {})}
    if not args.step_only:
        programs["prefill"] = (engine._prefill_jit, (graph, params, speculative, state, padded, None), {"final": True})
    with jax.set_mesh(mesh):
        for name, (jitted, call_args, kwargs) in programs.items():
            begin = time.perf_counter()
            lowered = jitted.lower(*call_args, **kwargs)
            lowered_s = time.perf_counter() - begin
            analysis = lowered.compile().memory_analysis()
            out[name] = {
                "lower_s": lowered_s,
                "compile_s": time.perf_counter() - begin - lowered_s,
                "argument_bytes": analysis.argument_size_in_bytes,
                "output_bytes": analysis.output_size_in_bytes,
                "alias_bytes": analysis.alias_size_in_bytes,
                "temp_bytes": analysis.temp_size_in_bytes,
            }
    print(json.dumps(out))


if __name__ == "__main__":
    main()
