"""MoE load balancing on a mesh (8 fake CPU devices): the routers run per device under `shard_map`, and the
loads the train step counts, hence the biases it moves, equal the one-device step's exactly; so does the
sequence-wise balance loss (to rounding)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from test_moe_balance import MOE as ONE_DEVICE_MOE  # tests/ is on sys.path (pytest's rootdir-relative import)

from mtp_jax import sharding
from mtp_jax.model import init_model
from mtp_jax.training import trainer as train

# test_moe_balance's tiny MoE, with wide router weights: no near-ties that summation order could flip
MOE = ONE_DEVICE_MOE.replace(initializer_range=0.2)
CONFIG = train.TrainConfig(
    batch_size=8, seq_len=16, num_steps=3, warmup_steps=0, learning_rate=1e-9, bias_update_speed=0.01, balance_alpha=0.1
)


def _steps(mesh, num_steps: int = 2):
    graphdef, params, frozen = train.split_model(init_model(MOE, seed=0), CONFIG)
    bias, frozen = train.split_bias(frozen, CONFIG)
    opt_state = train.make_optimizer(CONFIG).init(params)
    state = train.TrainState(step=jnp.zeros((), jnp.int32), params=params, opt_state=opt_state, bias=bias)
    if mesh is not None:
        state = sharding.place(state, train.train_state_shardings(state, mesh))
        frozen = sharding.shard_params(frozen, mesh)
    rng = np.random.default_rng(0)
    segment_ids = np.repeat(np.array([[1] * 10 + [2] * 4 + [0] * 2]), 8, axis=0).astype(np.int32)
    history = []
    for _ in range(num_steps):
        tokens = rng.integers(0, MOE.vocab_size, (8, 16)).astype(np.int32)
        state, metrics = train.train_step(
            state, frozen, tokens, segment_ids, graphdef=graphdef, config=CONFIG, mesh=mesh
        )
        history.append(sharding.to_host(metrics))
    return sharding.to_host(state.bias), history


@pytest.mark.parametrize("mesh_spec", ["data=8", "data=4,expert=2"])
def test_loads_and_biases_on_a_mesh_equal_one_devices(mesh_spec):
    bias, history = _steps(None)
    mesh_bias, mesh_history = _steps(sharding.make_mesh(mesh_spec))
    for one, many in zip(history, mesh_history, strict=True):
        assert set(one["expert_load"]) == {"layers/1/mlp/gate", "mtp/0/mlp/gate"}
        for name, load in one["expert_load"].items():
            np.testing.assert_array_equal(many["expert_load"][name], load)
            assert load.sum() == 2 * 8 * 14  # k choices of each of the 112 non-padding tokens
        np.testing.assert_allclose(many["balance_loss"], one["balance_loss"], rtol=1e-5)
    for a, b in zip(jax.tree.leaves(mesh_bias), jax.tree.leaves(bias), strict=True):
        np.testing.assert_array_equal(a, b)
        assert np.abs(b).max() > 0
