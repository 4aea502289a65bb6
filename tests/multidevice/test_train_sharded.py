"""Sharded training on 8 (fake CPU) devices: data parallel, FSDP and FSDP x tensor steps equal the
one-device step, the state sits where the logical-axis rules put it, the step compiles once, and a
checkpoint saved on one mesh restores (and resumes) on another mesh or on one device.

The optimizer runs with Adam's eps = 1: its update is then about linear in the gradient (lr x the
averaged gradient, hence the large lr), so the ~1e-8 summation-order differences of a sharded
gradient stay ~1e-8 in the parameters. With the default eps = 1e-8 Adam's first update is about
g / |g|, and a gradient entry of ~1e-10 (there are some) can flip sign under those differences:
the parameter then moves by +lr instead of -lr.

The last test runs `train` under `jax.distributed` on localhost: two processes of 4 CPU devices each.
"""

import json
import os
import pathlib
import socket
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from test_data import tiny_documents  # tests/ is on sys.path (pytest's rootdir-relative import)

from mtp_jax import sharding
from mtp_jax.config import ModelConfig
from mtp_jax.model import init_model
from mtp_jax.training import data
from mtp_jax.training import run_dir as run_dir_lib
from mtp_jax.training import trainer as train

CONFIG = train.TrainConfig(
    batch_size=8,
    seq_len=16,
    num_steps=3,
    learning_rate=0.5,
    warmup_steps=0,
    eps=1.0,
    checkpoint_every=100,
    log_every=1,
    eval_batches=1,
)
NUM_STEPS = 2  # steps compared per mesh


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    return data.prepare_corpus(
        tmp_path_factory.mktemp("corpus"), documents=tiny_documents(24), vocab_size=300, heldout_fraction=0.2
    )


@pytest.fixture(scope="module")
def model_config(corpus):
    return ModelConfig.from_name(
        "tiny",
        vocab_size=300,
        num_hidden_layers=1,
        num_key_value_heads=4,
        num_nextn_predict_layers=1,
        eos_token_id=corpus.eos_id,
    )


@pytest.fixture(scope="module")
def batches(corpus):
    packed = data.PackedBatches(corpus.train, CONFIG.batch_size, CONFIG.seq_len, seed=0)
    return [packed.batch(step) for step in range(NUM_STEPS)]


def _fresh(model_config, config):
    graphdef, params, frozen = train.split_model(init_model(model_config, seed=0), config)
    state = train.TrainState(
        step=jnp.zeros((), jnp.int32), params=params, opt_state=train.make_optimizer(config).init(params)
    )
    return graphdef, state, frozen


def _run(model_config, batches, config, mesh):
    """NUM_STEPS steps from the same initial model: (final state, losses, grad norms, compiles, in/out shardings)."""
    graphdef, state, frozen = _fresh(model_config, config)
    if mesh is not None:
        state = sharding.place(state, train.train_state_shardings(state, mesh))
        frozen = sharding.shard_params(frozen, mesh)
    before = jax.tree.map(lambda x: x.sharding, state)
    compiled = train._train_step._cache_size()
    losses, norms = [], []
    for tokens, segment_ids in batches:
        state, metrics = train.train_step(
            state, frozen, tokens, segment_ids, graphdef=graphdef, config=config, mesh=mesh
        )
        loss, norm = sharding.to_host((metrics["loss"], metrics["grad_norm"]))
        losses.append(float(loss))
        norms.append(float(norm))
    compiles = train._train_step._cache_size() - compiled
    return state, losses, norms, compiles, before, jax.tree.map(lambda x: x.sharding, state)


@pytest.fixture(scope="module")
def reference(model_config, batches):
    return _run(model_config, batches, CONFIG, None)


def _adam(state):
    adam = state.opt_state[-1][0]  # chain(clip, adamw): adamw = chain(scale_by_adam, decay, scale_by_lr)
    assert isinstance(adam.mu, nnx.State)
    return adam


def _kernel(tree, *path):
    for key in path:
        tree = tree[key]
    return tree[...]


def _assert_trees_close(a, b, rtol, atol):
    for (path, x), y in zip(jax.tree_util.tree_leaves_with_path(a), jax.tree.leaves(b), strict=True):
        np.testing.assert_allclose(
            np.asarray(y), np.asarray(x), rtol=rtol, atol=atol, err_msg=jax.tree_util.keystr(path)
        )


# (mesh, the spec the rules give the attention's qkv_proj kernel [embed, heads] and the embedding [vocab, embed])
MESHES = [
    ("data=8", P(), P()),  # data parallel: everything replicated
    ("data=2,fsdp=4", P("fsdp"), P(None, "fsdp")),  # FSDP: the "embed" axis split
    ("fsdp=2,tensor=4", P("fsdp", "tensor"), P("tensor", "fsdp")),
]


@pytest.mark.parametrize("spec, qkv_spec, embed_spec", MESHES)
def test_sharded_steps_equal_the_one_device_steps(model_config, batches, reference, spec, qkv_spec, embed_spec):
    mesh = sharding.make_mesh(spec)
    ref_state, ref_losses, ref_norms, _, _, _ = reference
    state, losses, norms, compiles, before, after = _run(model_config, batches, CONFIG, mesh)

    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
    np.testing.assert_allclose(norms, ref_norms, rtol=1e-5)
    initial = jax.tree.leaves(_fresh(model_config, CONFIG)[1].params)
    moved = max(
        float(np.abs(np.asarray(x) - np.asarray(y)).max())
        for x, y in zip(jax.tree.leaves(ref_state.params), initial, strict=True)
    )
    assert moved > 1e-3  # the steps moved the parameters by far more than the tolerance below
    assert int(sharding.to_host(state.step)) == NUM_STEPS
    _assert_trees_close(ref_state.params, state.params, rtol=1e-5, atol=1e-6)
    _assert_trees_close(_adam(ref_state).mu, _adam(state).mu, rtol=1e-5, atol=1e-8)
    _assert_trees_close(_adam(ref_state).nu, _adam(state).nu, rtol=1e-4, atol=1e-12)

    # Placement by the rules: parameters and both moments alike; scalars replicated.
    qkv = ("layers", 0, "self_attn", "qkv_proj", "kernel")
    for tree in (state.params, _adam(state).mu, _adam(state).nu):
        assert _kernel(tree, *qkv).sharding.spec == qkv_spec
        assert _kernel(tree, "embed_tokens", "embedding").sharding.spec == embed_spec
        assert _kernel(tree, "norm", "weight").sharding.spec == P()
    assert _adam(state).count.sharding.spec == P() and state.step.sharding.spec == P()
    qkv_kernel = _kernel(state.params, *qkv)
    assert qkv_kernel.sharding.is_equivalent_to(NamedSharding(mesh, qkv_spec), 2)
    if "fsdp" in spec:  # each device holds 1/fsdp of the rows (1/tensor of the columns)
        fsdp = mesh.shape["fsdp"]
        assert qkv_kernel.addressable_shards[0].data.shape == (64 // fsdp, qkv_kernel.shape[1] // mesh.shape["tensor"])

    # No recompiles: the step returns the state on the shardings it got.
    assert compiles == 1
    assert jax.tree.all(jax.tree.map(lambda x, y: x == y, before, after))


def test_batch_the_mesh_cannot_split_is_refused(tmp_path, corpus, model_config):
    with pytest.raises(ValueError, match=r"batch_size 4 does not fit the mesh: batch size 4 is not a multiple"):
        train.train(
            tmp_path / "run",
            corpus,
            model_config=model_config,
            train_config=CONFIG.replace(batch_size=4),
            mesh=sharding.make_mesh("fsdp=8"),
            progress=False,
            export=False,
        )
    assert not (tmp_path / "run").exists()  # refused before anything was written


@pytest.fixture(scope="module")
def straight(tmp_path_factory, corpus, model_config):
    """CONFIG's run on one device, in one go: what the sharded, resumed and multi-process runs end with."""
    return train.train(
        tmp_path_factory.mktemp("straight") / "run",
        corpus,
        model_config=model_config,
        train_config=CONFIG,
        progress=False,
        export=False,
    )


def test_checkpoint_of_one_mesh_restores_and_resumes_on_others(tmp_path, corpus, model_config, batches, straight):
    saving, resuming = sharding.make_mesh("data=2,fsdp=4"), sharding.make_mesh("fsdp=2,tensor=4")
    for mesh in (saving, resuming):  # the step compiled for a freshly placed state (cached if the test above ran)
        _run(model_config, batches, CONFIG, mesh)
    compiled = train._train_step._cache_size()
    run_dir = tmp_path / "run"
    first = train.train(
        run_dir,
        corpus,
        model_config=model_config,
        train_config=CONFIG,
        stop_at_step=2,
        mesh=saving,
        progress=False,
        export=False,
    )
    assert first.step == 2 and first.stopped_early
    saved = nnx.state(first.model)
    assert _kernel(saved, "layers", 0, "self_attn", "qkv_proj", "kernel").sharding.spec == P("fsdp")

    # Checkpoint 2, saved from data=2,fsdp=4, read onto data=2,tensor=4 and onto one device: the same values.
    other = sharding.make_mesh("data=2,tensor=4")
    on_other, _ = train.load_run(run_dir, 2, mesh=other)
    on_one, _ = train.load_run(run_dir, 2)
    for restored in (nnx.state(on_other), nnx.state(on_one)):
        for x, y in zip(jax.tree.leaves(saved), jax.tree.leaves(restored), strict=True):
            np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
    qkv = _kernel(nnx.state(on_other), "layers", 0, "self_attn", "qkv_proj", "kernel")
    assert qkv.sharding.mesh == other and qkv.sharding.spec == P(None, "tensor")
    assert _kernel(nnx.state(on_other), "embed_tokens", "embedding").sharding.spec == P("tensor")
    assert all(len(x.sharding.device_set) == 1 for x in jax.tree.leaves(nnx.state(on_one)))

    # The run resumes on fsdp=2,tensor=4, optimizer state included, and ends where the one-device run ends.
    resumed = train.train(run_dir, corpus, resume=True, mesh=resuming, progress=False, export=False)
    assert resumed.step == straight.step == CONFIG.num_steps and not resumed.stopped_early
    # `train` placed the fresh state, and orbax restored the saved one, on exactly those shardings: no compile.
    assert train._train_step._cache_size() == compiled
    params = nnx.state(resumed.model)
    assert _kernel(params, "layers", 0, "self_attn", "qkv_proj", "kernel").sharding.spec == P("fsdp", "tensor")
    _assert_trees_close(nnx.state(straight.model), params, rtol=1e-5, atol=1e-6)
    assert resumed.eval_metrics == pytest.approx(straight.eval_metrics, rel=1e-5)
    assert resumed.train_metrics["loss"] == pytest.approx(straight.train_metrics["loss"], rel=1e-5)


WORKER = """
import json, sys
spec, process_id = json.loads(open(sys.argv[1]).read()), int(sys.argv[2])
from mtp_jax import sharding
sharding.initialize_distributed(spec["coordinator"], 2, process_id)  # before any other jax use
from mtp_jax.training import data
from mtp_jax.training import trainer as train
from mtp_jax.training.run_dir import model_config_from_dict
corpus = data.prepare_corpus(spec["corpus_dir"], documents=spec["documents"], vocab_size=300, heldout_fraction=0.2)
result = train.train(spec["run_dir"], corpus, model_config=model_config_from_dict(spec["model_config"]),
                     train_config=train.TrainConfig(**spec["train_config"]), mesh=sharding.make_mesh("fsdp=8"),
                     progress=False, export=False)
print(json.dumps({"step": result.step, "train": result.train_metrics, "eval": result.eval_metrics}))
"""


def test_two_processes_train_as_one_device(tmp_path, corpus, model_config, straight):
    """`jax.distributed` on localhost: 2 processes x 4 CPU devices, one fsdp=8 mesh over all 8."""
    with socket.socket() as s:
        s.bind(("localhost", 0))
        port = s.getsockname()[1]
    run_dir = tmp_path / "run"
    spec = {
        "coordinator": f"localhost:{port}",
        "corpus_dir": str(corpus.work_dir),
        "documents": tiny_documents(24),
        "model_config": run_dir_lib.config_to_dict(model_config),
        "train_config": run_dir_lib.config_to_dict(CONFIG),
        "run_dir": str(run_dir),
    }
    (tmp_path / "spec.json").write_text(json.dumps(spec))
    root = pathlib.Path(__file__).parents[2]  # the workers import this tree's mtp_jax, as this process does
    env = dict(
        os.environ,
        JAX_PLATFORMS="cpu",
        PYTHONPATH=os.pathsep.join(filter(None, [str(root), os.environ.get("PYTHONPATH")])),
        XLA_FLAGS=f"{os.environ.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count=4".strip(),
    )
    env["XLA_FLAGS"] = env["XLA_FLAGS"].replace("--xla_force_host_platform_device_count=8", "")
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", WORKER, str(tmp_path / "spec.json"), str(i)],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for i in range(2)
    ]
    try:
        outputs = [proc.communicate(timeout=600) for proc in procs]
    finally:
        for proc in procs:
            proc.kill()
    for proc, (_, err) in zip(procs, outputs, strict=True):
        assert proc.returncode == 0, err[-4000:]
    results = [json.loads(out.strip().splitlines()[-1]) for out, _ in outputs]
    for result in results:
        del result["train"]["tokens_per_s"]
    assert results[0] == results[1]  # every process reads back the whole values (`sharding.to_host`)
    assert results[0]["step"] == straight.step == CONFIG.num_steps
    assert results[0]["train"]["loss"] == pytest.approx(straight.train_metrics["loss"], rel=1e-5)
    assert results[0]["eval"] == pytest.approx(straight.eval_metrics, rel=1e-5)
    # Process 0 alone wrote the run dir: each step logged once; the checkpoint holds the one-device values.
    log = [json.loads(line) for line in (run_dir / "log.jsonl").read_text().splitlines()]
    assert [(r["kind"], r["step"]) for r in log] == [("train", 1), ("train", 2), ("train", 3), ("eval", 3)]
    restored, _ = train.load_run(run_dir)
    _assert_trees_close(nnx.state(straight.model), nnx.state(restored), rtol=1e-5, atol=1e-6)
