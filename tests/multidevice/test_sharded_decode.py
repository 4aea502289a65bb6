"""Sharded decoding on 8 (fake CPU) devices: the same tokens as one device, the placement the rules
give (asserted on `.sharding`), and no recompiles after warm-up.

Greedy equality across placements holds up to floating-point summation order (a row-parallel matmul
adds its partial sums in another order): every single-device greedy reference here is checked to
decide each token by a top-1/top-2 logit margin far above that (> 1e-3 against differences of ~1e-6).
"""

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

from mtp_jax.cache import StackedCache
from mtp_jax.config import ModelConfig
from mtp_jax.decode import engine as engine_lib
from mtp_jax.decode.engine import DecodeEngine
from mtp_jax.decode.generation import generate, stream
from mtp_jax.decode.sampling import SamplingParams
from mtp_jax.decode.speculative import SpeculativeConfig
from mtp_jax.layers.attention import attend
from mtp_jax.model import init_model
from mtp_jax.sharding import argmax_last, make_mesh, shard_params

_COMMON = dict(
    vocab_size=128,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=4,
    max_position_embeddings=128,
    num_nextn_predict_layers=2,
    initializer_range=0.2,
)
GQA = ModelConfig(**_COMMON)
DEEPSEEK = ModelConfig(
    **{**_COMMON, "num_nextn_predict_layers": 1},
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
# Qwen3.5-shaped: Gated DeltaNet layers around a gated-attention layer (4 value heads: one per `tensor` device).
HYBRID = ModelConfig(
    **{**_COMMON, "num_hidden_layers": 3, "num_nextn_predict_layers": 1},
    layer_types=("linear_attention", "full_attention", "linear_attention"),
    linear_num_key_heads=2,
    linear_num_value_heads=4,
    linear_key_head_dim=8,
    linear_value_head_dim=8,
    attn_output_gate=True,
    use_qk_norm=True,
    rms_norm_unit_offset=True,
    partial_rotary_factor=0.25,
)
PROMPTS = [[3, 1, 4, 1, 5], [9, 2, 6, 5, 3, 5, 8, 9, 7], [2], [7, 7, 1, 8]]  # mixed lengths, one bucket
EAGLE = SpeculativeConfig(method="eagle", num_speculative_tokens=2)
VANILLA = SpeculativeConfig(method="vanilla", num_speculative_tokens=2)
MAX_NEW, CAPACITY = 16, 48


@pytest.fixture(scope="module")
def gqa():
    return init_model(GQA, seed=1)


@pytest.fixture(scope="module")
def deepseek():
    return init_model(DEEPSEEK, seed=2)


def assert_equivalent(sharding, expected, ndim):
    assert sharding.is_equivalent_to(expected, ndim), (sharding, expected)


@functools.partial(jax.jit, static_argnums=0)
def _full_logits(graph, params, tokens):
    return nnx.merge(graph, params).forward_full(tokens)[0]


_ONE_DEVICE = {}


def one_device(model, spec, **kwargs):
    """`generate` on one device (cached per model and arguments), checked to decide every greedy token
    by a top-1/top-2 logit margin above 1e-3 (a full recompute), so placements cannot flip a near-tie."""
    key = (id(model), spec, tuple(sorted(kwargs.items())))
    if key not in _ONE_DEVICE:
        result = generate(model, PROMPTS, max_new_tokens=MAX_NEW, max_length=CAPACITY, speculative=spec, **kwargs)
        if "sampling" not in kwargs:
            seqs = np.zeros((len(PROMPTS), CAPACITY), np.int32)
            for b, (prompt, out) in enumerate(zip(PROMPTS, result.tokens, strict=True)):
                seqs[b, : len(prompt) + len(out)] = prompt + out
            top2 = jax.lax.top_k(_full_logits(*nnx.split(model), jnp.asarray(seqs)), 2)[0]  # [B, S, 2]
            gaps = top2[..., 0] - top2[..., 1]
            for b, (prompt, out) in enumerate(zip(PROMPTS, result.tokens, strict=True)):
                assert float(gaps[b, len(prompt) - 1 : len(prompt) + len(out) - 1].min()) > 1e-3
        _ONE_DEVICE[key] = result
    return _ONE_DEVICE[key]


@pytest.mark.parametrize("spec", [None, EAGLE, VANILLA], ids=["plain", "eagle", "vanilla"])
def test_gqa_greedy_on_data_2_tensor_4_equals_one_device(gqa, spec):
    one = one_device(gqa, spec)
    sharded = generate(
        gqa, PROMPTS, max_new_tokens=MAX_NEW, max_length=CAPACITY, speculative=spec, mesh=make_mesh("data=2,tensor=4")
    )
    assert sharded.tokens == one.tokens
    assert sharded.finish_reasons == one.finish_reasons
    assert sharded.num_steps == one.num_steps
    if spec is not None:
        assert sharded.metrics == one.metrics
    np.testing.assert_allclose(np.concatenate(sharded.logprobs), np.concatenate(one.logprobs), rtol=1e-4, atol=1e-5)


def test_hybrid_greedy_on_data_2_tensor_4_equals_one_device_with_the_value_heads_split():
    """Qwen3.5's layers on a mesh: eagle tokens equal one device's, and the Gated DeltaNet's value heads (its
    state, z / a / b / out_proj) are split over `tensor` while in_proj_qkv stays whole."""
    model = init_model(HYBRID, seed=3)
    one = one_device(model, EAGLE)
    mesh = make_mesh("data=2,tensor=4")
    sharded = generate(model, PROMPTS, max_new_tokens=MAX_NEW, max_length=CAPACITY, speculative=EAGLE, mesh=mesh)
    assert sharded.tokens == one.tokens
    assert sharded.metrics == one.metrics
    engine = DecodeEngine(model, EAGLE, mesh=mesh)
    state, padded = engine.init_state(PROMPTS, max_new_tokens=MAX_NEW, max_length=CAPACITY)
    state = engine.step(engine.prefill(state, padded))
    assert_equivalent(state.cache[0].state.sharding, jax.NamedSharding(mesh, P("data", "tensor")), 4)
    layer = shard_params(nnx.state(model, nnx.Param), mesh)["layers"][0]["linear_attn"]
    assert_equivalent(layer["out_proj"]["kernel"][...].sharding, jax.NamedSharding(mesh, P("tensor", None)), 2)
    assert_equivalent(layer["A_log"][...].sharding, jax.NamedSharding(mesh, P("tensor")), 1)
    assert_equivalent(layer["in_proj_qkv"]["kernel"][...].sharding, jax.NamedSharding(mesh, P()), 2)


@pytest.mark.parametrize("mesh_spec", ["data=2,expert=4", "expert=2,tensor=4"])
def test_deepseek_v3_expert_parallel_greedy_equals_one_device(deepseek, mesh_spec):
    one = one_device(deepseek, EAGLE)
    sharded = generate(
        deepseek, PROMPTS, max_new_tokens=MAX_NEW, max_length=CAPACITY, speculative=EAGLE, mesh=make_mesh(mesh_spec)
    )
    assert sharded.tokens == one.tokens
    assert sharded.metrics == one.metrics


def test_sampled_outputs_equal_one_device_for_the_same_seeds(gqa):
    sampling = [SamplingParams(temperature=0.9, top_p=0.9, seed=s) for s in (11, 12, 13, 14)]
    spec = SpeculativeConfig(method="eagle", num_speculative_tokens=2, draft_sampling="sample")
    for speculative in (None, spec):
        one = one_device(gqa, speculative, sampling=tuple(sampling))
        sharded = generate(
            gqa,
            PROMPTS,
            max_new_tokens=MAX_NEW,
            max_length=CAPACITY,
            sampling=sampling,
            speculative=speculative,
            mesh=make_mesh("data=2,tensor=4"),
        )
        assert sharded.tokens == one.tokens


def test_parameters_and_state_are_placed_as_the_rules_say(gqa, deepseek):
    mesh = make_mesh("data=2,tensor=4")
    engine = DecodeEngine(gqa, EAGLE, mesh=mesh)
    params = engine._params
    assert params["embed_tokens"]["embedding"].sharding.spec == P("tensor", None)
    assert params["lm_head"]["kernel"].sharding.spec == P(None, "tensor")
    layer = params["layers"][0]
    assert layer["self_attn"]["qkv_proj"]["kernel"].sharding.spec == P(None, "tensor")
    assert layer["self_attn"]["o_proj"]["kernel"].sharding.spec == P("tensor", None)
    assert layer["mlp"]["gate_up_proj"]["kernel"].sharding.spec == P(None, "tensor")
    assert layer["mlp"]["down_proj"]["kernel"].sharding.spec == P("tensor", None)
    assert layer["input_layernorm"]["weight"].sharding.spec == P()
    assert params["mtp"][0]["eh_proj"]["kernel"].sharding.spec == P(None, None)  # (input 2E, embed): no fsdp
    # each device holds a quarter of the columns
    kernel = layer["self_attn"]["qkv_proj"]["kernel"]
    assert {s.data.shape for s in kernel.addressable_shards} == {(64, kernel.shape[1] // 4)}

    state, padded = engine.init_state(PROMPTS, max_new_tokens=MAX_NEW, max_length=CAPACITY)
    assert padded.sharding.spec == P("data", None)
    assert state.tokens.sharding.spec == P("data", None)
    assert state.cache[0].k.sharding.spec == P("data", None, "tensor", None)
    assert state.draft.caches[0].v.sharding.spec == P("data", None, "tensor", None)
    assert state.stop_tokens.sharding.spec == P("data", None)  # per row
    placed = jax.tree.map(lambda x: x.sharding, state)
    state = engine.step(engine.prefill(state, padded))  # the step keeps every array's placement
    jax.tree.map(lambda x, before: assert_equivalent(x.sharding, before, x.ndim), state, placed)

    ds = DecodeEngine(deepseek, EAGLE, mesh=make_mesh("data=2,expert=4"))
    moe = ds._params["layers"][1]["mlp"]
    assert moe["experts"]["gate_up_proj"].sharding.spec == P("expert", None, None)
    assert moe["experts"]["down_proj"].sharding.spec == P("expert", None, None)
    assert moe["gate"]["weight"].sharding.spec == P(None, None)
    assert {s.data.shape[0] for s in moe["experts"]["gate_up_proj"].addressable_shards} == {4}  # 16 experts / 4
    ds_state, _ = ds.init_state(PROMPTS, max_new_tokens=MAX_NEW, max_length=CAPACITY)
    # MLA's latent cache: rows over data, whole over tensor/expert (every head reads the whole latent)
    assert ds_state.cache[0].latent.sharding.spec == P("data", None, None)
    assert ds_state.cache[0].k_rope.sharding.spec == P("data", None, None)


def test_kv_heads_the_tensor_axis_does_not_divide_are_replicated():
    model = init_model(GQA.replace(num_key_value_heads=2), seed=3)
    engine = DecodeEngine(model, None, mesh=make_mesh("data=2,tensor=4"))
    state, _ = engine.init_state(PROMPTS, max_new_tokens=4, max_length=CAPACITY)
    assert state.cache[0].k.sharding.spec == P("data", None, None, None)
    attn = engine._params["layers"][0]["self_attn"]
    assert attn["qkv_proj"]["kernel"].sharding.spec == P(None, None)  # 2 KV groups: no whole-group split
    assert attn["o_proj"]["kernel"].sharding.spec == P("tensor", None)  # 4 query heads: one each
    one = generate(model, PROMPTS, max_new_tokens=8, max_length=CAPACITY)
    assert (
        generate(model, PROMPTS, max_new_tokens=8, max_length=CAPACITY, mesh=make_mesh("data=2,tensor=4")).tokens
        == one.tokens
    )


def test_a_batch_the_data_axis_does_not_divide_is_refused(gqa):
    with pytest.raises(ValueError, match=r"batch size 3 is not a multiple of the mesh's batch axes \('data',\)"):
        generate(gqa, PROMPTS[:3], max_new_tokens=4, max_length=CAPACITY, mesh=make_mesh("data=2,tensor=4"))


def test_no_recompiles_after_warm_up(gqa):
    mesh = make_mesh("data=2,tensor=4")
    engine = DecodeEngine(gqa, EAGLE, mesh=mesh)

    def once(prompts, max_new):
        state, padded = engine.init_state(prompts, max_new_tokens=max_new, max_length=CAPACITY)
        state = engine.step(engine.step(engine.prefill(state, padded)))
        return engine.result(engine.run(state), seconds=0.0)

    once(PROMPTS, MAX_NEW)
    sizes = [f._cache_size() for f in (engine_lib._prefill_jit, engine_lib._step_jit, engine_lib._run_jit)]
    other = [[5, 4, 3], [1, 2, 3, 4, 5, 6, 7, 8, 9, 10], [8], [6, 6]]  # same bucket, other contents
    once(other, 9)
    once(PROMPTS, 3)
    assert [f._cache_size() for f in (engine_lib._prefill_jit, engine_lib._step_jit, engine_lib._run_jit)] == sizes


def test_stream_on_a_mesh_joins_to_generate(gqa):
    mesh = make_mesh("data=4,tensor=2")
    gen = stream(gqa, PROMPTS, max_new_tokens=MAX_NEW, max_length=CAPACITY, speculative=EAGLE, mesh=mesh)
    joined = [[] for _ in PROMPTS]
    try:
        while True:
            for row, new in zip(joined, next(gen), strict=True):
                row.extend(new)
    except StopIteration as stop:
        result = stop.value
    assert joined == result.tokens
    assert joined == one_device(gqa, EAGLE).tokens


def test_scanned_layers_shard_with_a_leading_layer_axis():
    config = GQA.replace(num_hidden_layers=3, scan_layers=True)
    model = init_model(config, seed=1)
    engine = DecodeEngine(model, EAGLE, mesh=make_mesh("data=2,tensor=4"))
    stacked = engine._params["layer_groups"][0]["layer"]
    assert stacked["self_attn"]["qkv_proj"]["kernel"].sharding.spec == P(None, None, "tensor")
    state, _ = engine.init_state(PROMPTS, max_new_tokens=4, max_length=CAPACITY)
    assert isinstance(state.cache[0], StackedCache)
    assert state.cache[0].layers.k.sharding.spec == P(None, "data", None, "tensor", None)
    one = generate(model, PROMPTS, max_new_tokens=MAX_NEW, max_length=CAPACITY, speculative=EAGLE)
    sharded = generate(
        model,
        PROMPTS,
        max_new_tokens=MAX_NEW,
        max_length=CAPACITY,
        speculative=EAGLE,
        mesh=make_mesh("data=2,tensor=4"),
    )
    assert sharded.tokens == one.tokens


def test_the_pallas_kernel_runs_per_shard_and_matches_one_device():
    model = init_model(GQA.replace(attention_impl="pallas_interpret"), seed=1)
    mesh = make_mesh("data=2,tensor=4")
    q = jax.random.normal(jax.random.key(0), (4, 3, 4, 16))
    k, v = (jax.random.normal(jax.random.key(i), (4, 32, 4, 16)) for i in (1, 2))
    lengths = jnp.asarray([5, 32, 1, 17], jnp.int32)
    with jax.set_mesh(mesh):
        jaxpr = str(jax.make_jaxpr(lambda *a: attend(*a, impl="pallas_interpret"))(q, k, v, lengths))
        sharded = jax.jit(lambda *a: attend(*a, impl="pallas_interpret"))(q, k, v, lengths)
    assert "shard_map" in jaxpr and "pallas_call" in jaxpr
    np.testing.assert_allclose(sharded, attend(q, k, v, lengths, impl="reference"), rtol=1e-5, atol=1e-5)
    one = generate(model, PROMPTS, max_new_tokens=8, max_length=CAPACITY, speculative=EAGLE)
    assert (
        generate(model, PROMPTS, max_new_tokens=8, max_length=CAPACITY, speculative=EAGLE, mesh=mesh).tokens
        == one.tokens
    )


def test_the_draft_argmax_combines_vocabulary_shards_with_the_lowest_index_on_ties():
    logits = jnp.zeros((4, 128)).at[0, 5].set(3.0).at[0, 100].set(3.0)  # a tie across shards: 5 wins
    logits = logits.at[1, 127].set(1.0).at[2, 64].set(2.0).at[2, 65].set(2.0)  # row 3: all equal, index 0
    with jax.set_mesh(make_mesh("data=2,tensor=4")):
        jaxpr = str(jax.make_jaxpr(lambda x: argmax_last(x, P("batch", "vocab")))(logits))
        out = jax.jit(lambda x: argmax_last(x, P("batch", "vocab")))(logits)
    assert out.tolist() == [5, 127, 64, 0] == jnp.argmax(logits, axis=-1).tolist()
    assert "shard_map" in jaxpr and "all_gather" in jaxpr


def _step_collectives(model, mesh_spec, rows=8):
    """(kind, op_name) of every collective in the compiled decode step (eagle K=2) on `mesh_spec`."""
    engine = DecodeEngine(model, EAGLE, mesh=make_mesh(mesh_spec))
    state, _ = engine.init_state([[1, 2, 3]] * rows, max_new_tokens=8, max_length=32)
    with jax.set_mesh(engine.mesh):
        hlo = engine_lib._step_jit.lower(engine._graph, engine._params, EAGLE, state).compile().as_text()
    kinds = r"(all-reduce|all-gather|all-to-all|collective-permute|reduce-scatter)(?:-start)?"
    return [(m.group(1), m.group(2)) for m in re.finditer(kinds + r"\(.*?op_name=\"([^\"]+)\"", hlo)]


def test_a_data_parallel_step_communicates_only_its_row_wide_conditions(gqa, deepseek):
    for model in (gqa, deepseek):  # the cache writes, commits and the MoE's routing and sort stay on each device
        found = _step_collectives(model, "data=8")
        assert all(kind == "all-reduce" and re.search(r"reduce_(and|or)", name) for kind, name in found), found
        assert len(found) <= 3, found  # all greedy?, any top-k / top-p?, any penalty? (one bool each)


def test_the_fused_projections_split_without_moving_data_under_tensor_parallelism(gqa):
    found = _step_collectives(gqa, "data=2,tensor=4")
    # qkv_proj (group-major) and gate_up_proj (interleaved): a tensor shard holds whole heads and units
    assert not [f for f in found if f[0] == "collective-permute" and re.search(r"slice|split|scatter", f[1])], found
    assert sum(kind == "all-reduce" and "dot_general" in name for kind, name in found) >= 2  # row-parallel o/down


def test_expert_parallel_moe_layers_all_reduce_once_each(deepseek):
    found = _step_collectives(deepseek, "data=2,expert=4")
    # one per MoE layer call: the main model's MoE layer in the verify forward, the MTP module's (a MoE
    # layer) in its two calls of the draft (the K+1 verified rows, then the second draft)
    assert [kind for kind, name in found if "psum" in name] == ["all-reduce"] * 3, found
    assert all(kind == "all-reduce" for kind, _ in found), found


@pytest.mark.parametrize("model_name,mesh_spec", [("gqa", "data=2,tensor=4"), ("deepseek", "data=2,expert=4")])
def test_serving_engine_on_a_mesh_equals_one_device(request, model_name, mesh_spec):
    """Continuous batching on a mesh (staging rows over `data`, a prompt longer than one prefill chunk,
    requests arriving at different steps) gives each request the one-device `generate` tokens."""
    from mtp_jax.serving import ServingEngine

    model = request.getfixturevalue(model_name)
    one = one_device(model, EAGLE)
    engine = ServingEngine(model, EAGLE, max_batch=2, max_length=CAPACITY, prefill_chunk=4, mesh=make_mesh(mesh_spec))
    engine.warm_up()
    compiled = engine.compiled_counts()
    ids, got = [], {}
    for prompt in PROMPTS:  # one arrival per step, more requests than slots
        ids.append(engine.add_request(prompt, max_tokens=MAX_NEW))
        for out in engine.step():
            got.setdefault(out.request_id, []).extend(out.token_ids)
    while engine.has_unfinished():
        for out in engine.step():
            got.setdefault(out.request_id, []).extend(out.token_ids)
    assert [got[i] for i in ids] == one.tokens
    assert engine.compiled_counts() == compiled


def test_paged_serving_on_a_tensor_mesh_compiles_nothing_after_warm_up():
    """On `tensor=2` (pools split over the two KV heads) a prefix-cache hit (a prefill that starts wide, from
    a fresh staging state), a preemption and an abort (releases of a stepped state) compile nothing after
    `warm_up`, and the outputs are still the one-device `generate` tokens."""
    from mtp_jax.serving import ServingEngine

    model = init_model(GQA.replace(num_attention_heads=2, num_key_value_heads=2, hidden_size=32, head_dim=16), seed=1)
    mesh = make_mesh("tensor=2", jax.devices()[:2])
    shared = list(range(1, 21))
    runs = [  # (pages, requests: prompt, max_tokens, abort after this many tokens)
        (20, [(shared, 4, None)]),
        (20, [(shared + [5, 6], 4, None)]),  # the same engine: a prefix hit
        (11, [([1, 2], 36, None), ([3, 4], 36, None)]),  # a preemption
        (20, [([1, 2], 30, 8)]),  # an abort
    ]
    engines = {}
    for pages, requests in runs:
        if pages not in engines or pages == 11:
            engine = ServingEngine(
                model, EAGLE, max_batch=2, max_length=40, num_pages=pages, page_size=4, prefill_chunk=8, mesh=mesh
            )
            engine.warm_up()
            engines[pages] = engine
        engine = engines[pages]
        compiled = engine.compiled_counts()  # (programs are cached per shapes: another engine's compile more)
        ids = [engine.add_request(p, max_tokens=n, ignore_eos=True) for p, n, _ in requests]
        got = {i: [] for i in ids}
        while engine.has_unfinished():
            for out in engine.step():
                got[out.request_id] += out.token_ids
                stop = dict(zip(ids, [a for *_, a in requests], strict=True))[out.request_id]
                if stop is not None and len(got[out.request_id]) >= stop and not out.finished:
                    engine.abort(out.request_id)
        assert engine.compiled_counts() == compiled, (pages, requests)
        for rid, (prompt, n, stop) in zip(ids, requests, strict=True):
            expected = generate(model, [prompt], max_new_tokens=n, max_length=40).tokens[0]
            assert got[rid] == (expected if stop is None else expected[: len(got[rid])])
    assert engines[20].pages.hits > 0 and engines[11].num_preemptions > 0
