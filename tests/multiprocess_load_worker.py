"""One process of `tests/test_multiprocess_load.py`: joins a `jax.distributed` job, loads a checkpoint
shard-streamed onto meshes spanning every process's devices, counting the bytes it reads, and decodes;
writes what it read, what it should have read, and its tokens as JSON.

    python tests/multiprocess_load_worker.py COORDINATOR_ADDRESS NUM_PROCESSES PROCESS_ID CHECKPOINT OUT.json

The environment sets the local devices (`JAX_PLATFORMS=cpu`,
`XLA_FLAGS=--xla_force_host_platform_device_count=4`). The checkpoint is `write_checkpoint`'s, which the
test also loads onto one device for its reference tokens (`prompts()`, `MAX_NEW_TOKENS`, `speculative()`).

Bytes read are counted by wrapping `tensor_reads.read_into`, the one function that reads tensor data.
What a process should read (`expected_bytes`): for each parameter, the distinct indices its devices hold
(`addressable_devices_indices_map`; replicas share one read), each index's bytes in the stored dtype (the
loaded one: no `dtype` is passed); plus its share of the shared-tensor copies' check
(`shards.check_copies`): rows [p * ceil(R / P), (p + 1) * ceil(R / P)) of each copy and of its source.
"""

import json
import math
import pathlib
import sys
import time

import numpy as np

MESHES = ("data=2,tensor=4", "expert=2,tensor=4")  # data across the processes; experts across them
PROMPT_LENGTHS = (3, 9, 14, 6)
MAX_NEW_TOKENS = 10
MAX_LENGTH = 40
MAX_SHARD_SIZE_BYTES = 60_000  # several files
COPIES_FILE = "model-mtp-copies.safetensors"


def config():
    """A tiny DeepSeek-V3-shaped model: MLA, one dense layer then MoE (16 routed experts, a shared one),
    one MTP layer, float32."""
    from mtp_jax.config import ModelConfig

    return ModelConfig(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=8,
        num_key_value_heads=8,
        max_position_embeddings=128,
        num_nextn_predict_layers=1,
        initializer_range=0.2,
        attention_type="mla",
        q_lora_rank=24,
        kv_lora_rank=16,
        qk_nope_head_dim=16,
        qk_rope_head_dim=8,
        v_head_dim=16,
        ffn_type="moe",
        moe_intermediate_size=16,
        n_routed_experts=16,
        num_experts_per_tok=4,
        n_shared_experts=1,
        n_group=4,
        topk_group=2,
        routed_scaling_factor=2.5,
        first_k_dense_replace=1,
    )


def prompts() -> list[list[int]]:
    rng = np.random.default_rng(0)
    return [rng.integers(1, 128, n).tolist() for n in PROMPT_LENGTHS]


def speculative():
    from mtp_jax.decode.speculative import SpeculativeConfig

    return SpeculativeConfig(method="eagle", num_speculative_tokens=2)


def write_checkpoint(path) -> None:
    """`save_hf_checkpoint` of `config()`'s model (seed 0) in several files, with DeepSeek-V3's copies of
    the shared tensors (`names.shared_copies`: the MTP layer's `embed_tokens` and `shared_head.head`): those
    the save does not write go into a file of their own, listed in the index."""
    import pathlib

    from safetensors import safe_open
    from safetensors.numpy import save_file

    from mtp_jax.checkpoints import save_hf_checkpoint
    from mtp_jax.checkpoints.format import INDEX_FILE
    from mtp_jax.checkpoints.names import shared_copies
    from mtp_jax.model import init_model

    path = pathlib.Path(path)
    save_hf_checkpoint(init_model(config(), seed=0), path, max_shard_size_bytes=MAX_SHARD_SIZE_BYTES)
    index = json.loads((path / INDEX_FILE).read_text())
    copies = {}
    for copy, source in shared_copies(config()).items():
        if copy not in index["weight_map"]:
            with safe_open(path / index["weight_map"][source], framework="np") as f:
                copies[copy] = f.get_tensor(source)
    if copies:
        save_file(copies, path / COPIES_FILE, metadata={"format": "pt"})
        index["weight_map"].update(dict.fromkeys(copies, COPIES_FILE))
        index["metadata"]["total_size"] += sum(t.nbytes for t in copies.values())
        (path / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n")


def stored_tensors(path) -> dict[str, tuple[tuple[int, ...], int]]:
    """HF name -> (shape, bytes per element) of every tensor in the checkpoint's files."""
    import pathlib

    from safetensors import safe_open

    from mtp_jax.checkpoints.format import INDEX_FILE
    from mtp_jax.checkpoints.tensor_reads import DTYPES

    path = pathlib.Path(path)
    out = {}
    for file in sorted(set(json.loads((path / INDEX_FILE).read_text())["weight_map"].values())):
        with safe_open(path / file, framework="np") as f:
            for name in f.keys():
                tensor = f.get_slice(name)
                out[name] = (tuple(tensor.get_shape()), DTYPES[tensor.get_dtype()].itemsize)
    return out


def expected_bytes(model, stored: dict, process_index: int, process_count: int) -> int:
    """The bytes this process should read to load `model` shard-streamed (see the module docstring)."""
    import jax
    from flax import nnx

    from mtp_jax.checkpoints.names import shared_copies

    total = 0
    for leaf in jax.tree.leaves(nnx.state(model, nnx.Param)):
        indices = leaf.sharding.addressable_devices_indices_map(leaf.shape).values()
        distinct = {tuple(s.indices(n) for s, n in zip(index, leaf.shape, strict=True)) for index in indices}
        total += sum(math.prod(stop - start for start, stop, _ in key) for key in distinct) * leaf.dtype.itemsize
    for copy, source in shared_copies(model.config).items():
        if copy in stored:
            (rows, *rest), itemsize = stored[copy]
            share = -(-rows // process_count)
            mine = max(0, min(rows, (process_index + 1) * share) - process_index * share)
            total += mine * math.prod(rest) * (itemsize + stored[source][1])
    return total


def main(coordinator_address: str, num_processes: int, process_id: int, checkpoint: str, out: str) -> None:
    from mtp_jax.distributed import initialize_distributed

    start = time.perf_counter()
    assert initialize_distributed(coordinator_address, num_processes, process_id)  # before any other jax call
    import jax
    from flax import nnx

    from mtp_jax.checkpoints import CheckpointError, load_hf_checkpoint, tensor_reads
    from mtp_jax.decode.generation import generate
    from mtp_jax.sharding import make_mesh

    reads = []
    original = tensor_reads.read_into
    tensor_reads.read_into = lambda fd, buffer, offset: (reads.append(len(buffer)), original(fd, buffer, offset))
    stored = stored_tensors(checkpoint)
    result = dict(
        process_index=jax.process_index(),
        process_count=jax.process_count(),
        local_devices=jax.local_device_count(),
        global_devices=jax.device_count(),
        checkpoint_bytes=sum(math.prod(shape) * itemsize for shape, itemsize in stored.values()),
        loads={},
    )
    models = {}
    for spec in MESHES:
        reads.clear()
        mesh = make_mesh(spec)
        models[spec] = model = load_hf_checkpoint(checkpoint, mesh=mesh)
        result["loads"][spec] = dict(
            bytes_read=sum(reads),
            reads=len(reads),
            expected_bytes=expected_bytes(model, stored, jax.process_index(), jax.process_count()),
            sharded_params=sum(
                not x.sharding.is_fully_replicated for x in jax.tree.leaves(nnx.state(model, nnx.Param))
            ),
        )
    tensor_reads.read_into = original
    bad = pathlib.Path(f"{checkpoint}-bad")  # a copy that differs from its source in its last row only
    if bad.is_dir():
        try:
            load_hf_checkpoint(bad, mesh=make_mesh(MESHES[1]))
            result["bad_error"] = None
        except CheckpointError as error:
            result["bad_error"] = str(error)

    kwargs = dict(max_new_tokens=MAX_NEW_TOKENS, max_length=MAX_LENGTH)
    data, expert = MESHES
    result["plain"] = generate(models[data], prompts(), mesh=make_mesh(data), **kwargs).tokens
    result["plain_expert"] = generate(models[expert], prompts(), mesh=make_mesh(expert), **kwargs).tokens
    result["eagle"] = generate(
        models[expert], prompts(), mesh=make_mesh(expert), speculative=speculative(), **kwargs
    ).tokens
    result["seconds"] = time.perf_counter() - start
    with open(out, "w") as f:
        json.dump(result, f)
    jax.distributed.shutdown()


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4], sys.argv[5])
