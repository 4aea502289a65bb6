"""`mtp_jax.sharding` on one device: mesh specs, the rules' resolution (on abstract meshes of any
shape), and that every parameter of every architecture names its axes. The sharded runs themselves are
in `tests/multidevice/` (8 fake devices)."""

import jax
import jax.numpy as jnp
import pytest
from flax import nnx
from jax.sharding import AbstractMesh
from jax.sharding import PartitionSpec as P
from speculative_helpers import TINY_MOE

from mtp_jax import sharding
from mtp_jax.cache import StackedCache, logical_axes
from mtp_jax.config import ModelConfig
from mtp_jax.decode.engine import DecodeEngine
from mtp_jax.decode.generation import generate
from mtp_jax.decode.speculative import SpeculativeConfig
from mtp_jax.layers.moe import ScoreCorrectionBias
from mtp_jax.model import init_model
from mtp_jax.sharding import MESH_AXES, make_mesh, parse_mesh_spec, resolve

_COMMON = dict(
    vocab_size=64,
    hidden_size=32,
    intermediate_size=48,
    num_hidden_layers=3,
    num_attention_heads=4,
    max_position_embeddings=64,
    num_nextn_predict_layers=1,
)
CONFIGS = {
    "llama": ModelConfig(**_COMMON, num_key_value_heads=2),
    "qwen2": ModelConfig(**_COMMON, num_key_value_heads=2, attention_bias=True, tie_word_embeddings=True),
    "deepseek_v3": ModelConfig(
        **_COMMON,
        **TINY_MOE,
        num_key_value_heads=4,
        attention_type="mla",
        q_lora_rank=24,
        kv_lora_rank=16,
        qk_nope_head_dim=16,
        qk_rope_head_dim=8,
        v_head_dim=16,
    ),
    "deepseek_v2_lite": ModelConfig(
        **_COMMON,
        **TINY_MOE,
        num_key_value_heads=4,
        attention_type="mla",
        kv_lora_rank=16,
        qk_nope_head_dim=16,
        qk_rope_head_dim=8,
        v_head_dim=16,
    ),
    "glm4_moe": ModelConfig(
        **_COMMON,
        **TINY_MOE,
        num_key_value_heads=2,
        head_dim=16,
        partial_rotary_factor=0.5,
        use_qk_norm=True,
        attention_bias=True,
    ),
}


def mesh_of(**sizes):
    return AbstractMesh(tuple(sizes.get(a, 1) for a in MESH_AXES), MESH_AXES)


def test_mesh_specs_parse_and_bad_ones_are_named():
    assert parse_mesh_spec("data=2,tensor=4") == {"data": 2, "tensor": 4}
    assert parse_mesh_spec(" expert = 8 ") == {"expert": 8}
    assert parse_mesh_spec({"fsdp": -1}) == {"fsdp": -1}
    for spec, message in (
        ("model=2", "unknown mesh axis 'model'"),
        ("data=2,data=2", "given twice"),
        ("data=x", "needs an integer size"),
        ("data", "is not 'axis=size'"),
        ("data=0", "needs a size >= 1"),
        ("data=-1,tensor=-1", "at most one"),
        ("", "mesh spec"),
    ):
        with pytest.raises(ValueError, match=message):
            parse_mesh_spec(spec)


def test_make_mesh_has_every_axis_and_checks_the_device_count():
    mesh = make_mesh("data=1")
    assert mesh.axis_names == MESH_AXES and dict(mesh.shape) == dict.fromkeys(MESH_AXES, 1)
    assert dict(make_mesh("tensor=-1").shape)["tensor"] == jax.device_count()
    with pytest.raises(ValueError, match=r"mesh 'data=2,tensor=4' has 8 devices but 1 are given"):
        make_mesh("data=2,tensor=4")


def test_resolve_follows_the_rules_and_replicates_what_does_not_divide():
    mesh = mesh_of(data=2, tensor=4)
    assert resolve(P("batch", None, "kv_heads", None), (8, 16, 4, 8), mesh) == P("data", None, "tensor", None)
    assert resolve(P("batch", None, "kv_heads", None), (8, 16, 2, 8), mesh) == P("data", None, None, None)
    assert resolve(P("embed", "heads"), (32, 64), mesh) == P(None, "tensor")  # fsdp has size 1
    assert resolve(P("embed", "heads"), (32, 64), mesh_of(fsdp=2, tensor=4)) == P("fsdp", "tensor")
    assert resolve(P("batch", None), (8, 3), mesh_of(data=2, fsdp=2)) == P(("data", "fsdp"), None)
    assert resolve(P("experts", "embed", "moe_mlp"), (8, 32, 16), mesh_of(expert=4)) == P("expert", None, None)
    assert resolve(P("batch", None, "vocab"), (4, 2, 0), mesh) == P()  # empty: nothing to split
    assert resolve(P(None, "embed"), (64, 32), mesh_of(fsdp=2)) == P(None, "fsdp")
    assert resolve(P("embed", "embed"), (32, 32), mesh_of(fsdp=2)) == P("fsdp", None)  # an axis is used once
    # blocks: 2 KV groups of 6 heads' columns do not split 4 ways, 4 heads of 16 columns do
    assert resolve(P(None, ("heads", 96)), (32, 192), mesh) == P(None, None)
    assert resolve(P(("heads", 16), None), (64, 32), mesh) == P("tensor", None)
    with pytest.raises(ValueError, match=r"batch size 3 is not a multiple of the mesh's batch axes \('data',\)"):
        resolve(P("batch", None), (3, 8), mesh)
    with pytest.raises(ValueError, match="unknown logical axis 'hidden'"):
        resolve(P("hidden"), (8,), mesh)
    with pytest.raises(ValueError, match="more entries than the array's shape"):
        resolve(P("batch", None), (8,), mesh)


@pytest.mark.parametrize("scan", [False, True], ids=["unrolled", "scanned"])
@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_every_matrix_parameter_names_its_axes_and_the_rules_know_them(name, scan):
    config = CONFIGS[name].replace(scan_layers=scan)
    model = nnx.eval_shape(lambda: init_model(config))
    named = 0
    for path, variable in nnx.to_flat_state(nnx.state(model, nnx.Param)):
        axes = variable.get_metadata().get("logical_axes")
        key = "/".join(map(str, path))
        if axes is None:  # only vectors that every device keeps whole: norms, the router's bias
            assert isinstance(variable, ScoreCorrectionBias) or key.endswith("norm/weight") or ("layernorm" in key), key
            continue
        named += 1
        assert len(axes) == variable.ndim, (key, axes, variable.shape)
        assert (axes[0] == "layers") == (scan and key.startswith("layer_groups")), (key, axes)
        resolve(P(*axes), variable.shape, mesh_of(data=2, fsdp=2, expert=2, tensor=4))  # all names known
    assert named > 0


def test_cache_logical_axes_mirror_the_cache_and_stacked_caches_lead_with_layers():
    model = init_model(CONFIGS["deepseek_v3"].replace(scan_layers=True))
    cache = model.init_cache(2, 16)
    axes = logical_axes(cache)
    assert jax.tree.structure(axes) == jax.tree.structure(cache)
    assert isinstance(axes[1], StackedCache)
    assert axes[1].layers.latent == P("layers", "batch", "cache_sequence", "latent")
    gqa = init_model(CONFIGS["llama"]).init_cache(2, 16)
    assert logical_axes(gqa)[0].k == P("batch", "cache_sequence", "kv_heads", "head_dim")


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_vocab_argmax_is_jnp_argmax_on_ties_infinities_and_nans(dtype):
    inf, nan = float("inf"), float("nan")
    rows = [
        [1.0, 3.0, 3.0, 2.0],  # a tie: the lowest index
        [-inf, -inf, -inf, -inf],  # all -inf: index 0
        [0.0, inf, 5.0, inf],
        [1.0, nan, 9.0, nan],  # a NaN ranks above every number: the first NaN
        [nan, 1.0, 2.0, 3.0],
        [-2.0, -1.0, -3.0, -1.5],
    ]
    x = jnp.asarray(rows, dtype)
    assert sharding.vocab_argmax(x).tolist() == jnp.argmax(x, axis=-1).tolist() == [1, 0, 1, 1, 0, 1]
    assert sharding.vocab_argmax(x).dtype == jnp.int32
    big = jax.random.normal(jax.random.key(0), (3, 2, 32000)).astype(dtype)  # [B, T, V], many bfloat16 ties
    assert (jax.jit(sharding.vocab_argmax)(big) == jnp.argmax(big, axis=-1)).all()


def test_without_a_mesh_nothing_is_constrained_and_a_one_device_mesh_changes_no_token():
    x = jnp.ones((4, 8))
    assert sharding.constrain(x, P("batch", None)) is x
    assert sharding.axis_size("expert") == 1
    assert sharding.argmax_last(jnp.asarray([[1.0, 3.0, 3.0]]), P("batch", "vocab")).tolist() == [1]
    model = init_model(CONFIGS["deepseek_v3"], seed=4)
    spec = SpeculativeConfig(method="eagle", num_speculative_tokens=2)
    prompts = [[1, 2, 3], [4, 5]]
    one = generate(model, prompts, max_new_tokens=6, max_length=32, speculative=spec)
    on_mesh = generate(model, prompts, max_new_tokens=6, max_length=32, speculative=spec, mesh=make_mesh("data=1"))
    assert on_mesh.tokens == one.tokens
    assert DecodeEngine(model, spec, mesh=make_mesh("expert=1")).mesh is not None


def test_initialize_distributed_needs_all_three_or_none(monkeypatch):
    for name in ("JAX_COORDINATOR_ADDRESS", "JAX_NUM_PROCESSES", "JAX_PROCESS_ID", "JAX_DISTRIBUTED"):
        monkeypatch.delenv(name, raising=False)
    assert sharding.initialize_distributed() is False  # one process: nothing to do
    with pytest.raises(ValueError, match="need all of coordinator_address, num_processes and process_id"):
        sharding.initialize_distributed(coordinator_address="127.0.0.1:1234")
    monkeypatch.setenv("JAX_NUM_PROCESSES", "2")
    with pytest.raises(ValueError, match="num_processes=2"):
        sharding.initialize_distributed()
