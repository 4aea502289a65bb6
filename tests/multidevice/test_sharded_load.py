"""Shard-streamed loading (`load_hf_checkpoint(..., mesh=)`) on 8 fake CPU devices: every parameter lands
on the sharding `shard_model` would give it, every device's shard equals the same slice of the model
loaded onto one device, logits agree, and the files' bytes are each read once (a device reads only
its own rows/columns; replicas share one read)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from mtp_jax.checkpoints import load_hf_checkpoint, save_hf_checkpoint, tensor_reads
from mtp_jax.checkpoints.names import shared_copies
from mtp_jax.config import ModelConfig
from mtp_jax.model import init_model
from mtp_jax.quantization import Fp8Config
from mtp_jax.sharding import make_mesh, named_shardings, param_logical_axes

_COMMON = dict(
    vocab_size=128,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=8,
    num_key_value_heads=4,
    head_dim=8,
    max_position_embeddings=128,
    num_nextn_predict_layers=1,
    initializer_range=0.2,
)
GQA = ModelConfig(**_COMMON, attention_bias=True)
DEEPSEEK = ModelConfig(
    **_COMMON | {"num_key_value_heads": 8},
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
TOKENS = jnp.asarray([[3, 1, 4, 1, 5, 9, 2, 6], [5, 3, 5, 8, 9, 7, 9, 3]], jnp.int32)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    paths = {}
    fp8 = DEEPSEEK.replace(quantization=Fp8Config(weight_block_size=(16, 8)))  # partial edge blocks
    for name, config in (("gqa", GQA), ("deepseek", DEEPSEEK), ("deepseek-fp8", fp8)):
        paths[name] = tmp_path_factory.mktemp(name)
        save_hf_checkpoint(init_model(config, seed=3), paths[name], max_shard_size_bytes=40_000)  # several files
    return paths


def _flat(model):
    return dict(nnx.to_flat_state(nnx.state(model, nnx.Param)))


@pytest.mark.parametrize(
    "name,mesh_spec,scan",
    [
        ("gqa", "tensor=8", False),
        ("gqa", "fsdp=2,tensor=4", True),
        ("deepseek", "tensor=8", False),
        ("deepseek", "data=2,expert=4", False),
        ("deepseek", "expert=2,tensor=4", True),
        ("deepseek-fp8", "tensor=8", False),
        ("deepseek-fp8", "data=2,expert=2,tensor=2", True),
    ],
)
def test_each_device_reads_its_shard_and_the_model_equals_one_device(checkpoints, name, mesh_spec, scan, monkeypatch):
    checkpoint = checkpoints[name]
    reference = load_hf_checkpoint(checkpoint, scan_layers=scan)
    mesh = make_mesh(mesh_spec)
    read = []
    original = tensor_reads.read_into
    monkeypatch.setattr(tensor_reads, "read_into", lambda fd, buf, off: (read.append(len(buf)), original(fd, buf, off)))
    model = load_hf_checkpoint(checkpoint, mesh=mesh, scan_layers=scan)
    monkeypatch.undo()

    state = nnx.state(model, nnx.Param)
    expected = named_shardings(state, param_logical_axes(state), mesh)
    sharded = 0
    for (path, variable), (_, sharding) in zip(nnx.to_flat_state(state), nnx.to_flat_state(expected), strict=True):
        value, want = variable.get_value(), np.asarray(_flat(reference)[path].get_value())
        assert value.sharding.is_equivalent_to(sharding.get_value(), value.ndim), path
        for shard in value.addressable_shards:
            np.testing.assert_array_equal(np.asarray(shard.data), want[shard.index], err_msg=str(path))
        sharded += not value.sharding.is_fully_replicated
    assert sharded >= 4  # the mesh split the model

    # Each tensor's bytes were read once (the shards of a sharded tensor partition it, replicas share a
    # read); a stored copy of a shared tensor (the MTP layer's embed_tokens, shared_head.head) is compared
    # with its source, which reads both once more.
    files = [tensor_reads.TensorFile(f, f) for f in checkpoint.glob("*.safetensors")]
    entries = {name: entry for f in files for name, entry in f.entries.items()}
    nbytes = {
        name: int(np.prod(shape)) * tensor_reads.DTYPES[dtype].itemsize for name, (dtype, shape, _) in entries.items()
    }
    copies = {c: source for c, source in shared_copies(model.config).items() if c in entries}
    assert copies  # the export wrote them
    # FP8 scales: per block, replicated over `tensor` (a replica's read is shared), split over `expert`.
    assert sum(read) == sum(nbytes.values()) + sum(nbytes[c] for c in copies)

    with jax.set_mesh(mesh):
        logits = jax.jit(lambda m, t: m.forward_full(t)[0])(model, TOKENS)
    np.testing.assert_allclose(np.asarray(logits), np.asarray(reference.forward_full(TOKENS)[0]), atol=2e-5)
