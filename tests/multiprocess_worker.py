"""One process of `tests/test_multiprocess.py`: joins a `jax.distributed` job, decodes on a mesh that
spans every process's devices (plain from the host's weights, eagle from weights already sharded over
both processes), writes its tokens as JSON.

    python tests/multiprocess_worker.py COORDINATOR_ADDRESS NUM_PROCESSES PROCESS_ID OUT.json

The environment sets the local devices (`JAX_PLATFORMS=cpu`,
`XLA_FLAGS=--xla_force_host_platform_device_count=4`). The prompts and model are `PROMPTS` and
`model()`, which the test also uses for its single-device reference.
"""

import json
import sys
import time

import numpy as np

PROMPT_LENGTHS = (3, 9, 14, 6)
MAX_NEW_TOKENS = 10
MAX_LENGTH = 40
MESH = "data=2,tensor=4"


def prompts() -> list[list[int]]:
    rng = np.random.default_rng(0)
    return [rng.integers(1, 128, n).tolist() for n in PROMPT_LENGTHS]


def model():
    from mtp_jax.config import ModelConfig
    from mtp_jax.model import init_model

    return init_model(ModelConfig.from_name("tiny", num_key_value_heads=4, num_nextn_predict_layers=2), seed=0)


def speculative():
    from mtp_jax.decode.speculative import SpeculativeConfig

    return SpeculativeConfig(method="eagle", num_speculative_tokens=2)


def main(coordinator_address: str, num_processes: int, process_id: int, out: str) -> None:
    from mtp_jax.sharding import initialize_distributed

    start = time.perf_counter()
    assert initialize_distributed(coordinator_address, num_processes, process_id)  # before any other jax call
    import jax

    from mtp_jax.decode.generation import generate
    from mtp_jax.sharding import make_mesh, shard_model

    mesh = make_mesh(MESH)  # every process's devices
    kwargs = dict(max_new_tokens=MAX_NEW_TOKENS, max_length=MAX_LENGTH, mesh=mesh)
    m = model()
    plain = generate(m, prompts(), **kwargs)  # weights from this process's host copy to its devices' shards
    # weights that already span both processes (tensor=8): the engine moves them device to device
    shard_model(m, make_mesh(f"tensor={jax.device_count()}"))
    eagle = generate(m, prompts(), speculative=speculative(), **kwargs)
    result = dict(
        process_index=jax.process_index(),
        process_count=jax.process_count(),
        local_devices=jax.local_device_count(),
        global_devices=jax.device_count(),
        plain=plain.tokens,
        eagle=eagle.tokens,
        eagle_steps=eagle.num_steps,
        seconds=time.perf_counter() - start,
    )
    with open(out, "w") as f:
        json.dump(result, f)
    jax.distributed.shutdown()


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4])
