"""Shared setup of the speculative-decoding tests (`test_acceptance`, `test_drafters`, `test_engine`; the draft
oracle and the step driver also serve `test_architectures`): the models, the no-cache draft oracle and a driver
of the jitted step. The `models` and `plain` fixtures built from them live in `conftest.py`, session-scoped, so
every file shares the models and each plain-greedy reference is computed once.

One model configuration (vocab 8, D = 3) and one capacity S serve every test, so each (method, K) compiles
once per test module. Two kinds of weights: random (large enough to matter; acceptance is rare) and scripted
(`scripted`: the main model runs through two cycles and each MTP module is wrong for chosen tokens, by
construction with margins of nats), so steps that accept nothing, some and all of the drafts occur on every
CPU, and every situation a test needs (a stop token accepted as a draft, a cap met inside a block) is built,
not hoped for.
"""

from __future__ import annotations

import functools
import itertools

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from mtp_jax.cache import fill_stale
from mtp_jax.config import ModelConfig
from mtp_jax.decode.engine import DecodeEngine
from mtp_jax.decode.speculative import SpeculativeConfig
from mtp_jax.model import init_model, sequence_positions
from mtp_jax.mtp import MAIN_PARAMS, initial_hidden, mtp_forward_full

# The MoE fields of the test suite's tiny MoE models (test_onednn, test_scan, test_sharding, test_architectures):
# 8 routed experts of width 16, 2 per token, one shared; layer 0 dense.
TINY_MOE = dict(
    ffn_type="moe",
    moe_intermediate_size=16,
    n_routed_experts=8,
    n_shared_experts=1,
    num_experts_per_tok=2,
    first_k_dense_replace=1,
)
CFG = ModelConfig(
    vocab_size=8,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=1,
    num_attention_heads=2,
    num_key_value_heads=1,
    head_dim=16,
    max_position_embeddings=64,
    num_nextn_predict_layers=3,
)
D, V = CFG.num_nextn_predict_layers, CFG.vocab_size
S = 40  # the cache capacity of every generation here
W = S + 4  # oracle sequence width: committed tokens plus up to 4 drafts
THINK, END_THINK = 6, 7  # `<think>`, `</think>`
CYCLES = [[1, 2, 3, 1, 4, 2, 5, 3], [6, 7, 0, 6, 0, 7]]  # prompt material: tokens 1..5, and 0, 6, 7
PROMPTS = [[6, 7, 0, 6], [1, 2, 3, 1, 4, 2, 5, 3, 1], [5]]  # lengths 4, 9, 1 (one prompt bucket); B = 3
MAX_NEW = [25, 20, 30]
# The cache attention of every model call: on a GPU `attention_impl="auto"` picks the Pallas kernel, so
# what holds for the reference must hold for the kernel too (in Pallas' interpreter here).
IMPLS = ["reference", "pallas_interpret"]


def spec(method: str, k: int, **kwargs) -> SpeculativeConfig:
    """Every config names the think tokens (relaxed acceptance stays off unless asked): with the feature
    off, naming them must change nothing."""
    return SpeculativeConfig(
        method=method, num_speculative_tokens=k, think_start_token_id=THINK, think_end_token_id=END_THINK, **kwargs
    )


def style(method: str) -> str:
    return "parallel" if method == "parallel" else "deepseek"


# ---------------------------------------------------------------------------------------------
# Models


def make_model(config: ModelConfig, seed: int, std: float):
    """A model with weights ~ N(0, std^2); norm weights 1 for small std, else ~ U(0.5, 1.5) (std 0.3: logits
    with a spread of a few nats). Built abstractly and filled from numpy: no initializer compiles, and one
    graph per config, so every model of a config shares each compiled step."""
    model = nnx.eval_shape(lambda: init_model(config))
    rng = np.random.default_rng(seed)
    for path, var in nnx.iter_graph(model):
        if isinstance(var, nnx.Param):
            shape = var.get_value().shape
            if path[-1] == "weight":
                value = rng.uniform(0.5, 1.5, shape) if std > 0.1 else np.ones(shape)
            else:
                value = rng.normal(0.0, std, shape)
            var.set_value(jnp.asarray(value, jnp.float32))
    return model


def add(var, index, value) -> None:
    """`var[index] += value` for an `nnx.Param`."""
    w = np.array(var.get_value())
    w[index] += value
    var.set_value(jnp.asarray(w, jnp.float32))


SUCCESSOR = np.array([6, 2, 3, 4, 5, 1, 7, 0])  # scripted main model: 1 -> 2 -> 3 -> 4 -> 5 -> 1, 0 -> 6 -> 7 -> 0
# READS[k][t]: the token MTP module k + 1 acts on where the token it stands for is t; its draft is right
# exactly where READS[k][t] == t. Module 1 is wrong for 3 and 4, module 2 for 5, module 3 for 2.
READS = [np.array([0, 1, 2, 4, 5, 5, 6, 7]), np.array([0, 1, 2, 3, 4, 1, 6, 7]), np.array([0, 1, 3, 3, 4, 5, 6, 7])]


def scripted(config: ModelConfig, seed: int):
    """A model whose greedy behaviour is set by construction, not by numerics: the main model continues
    every token t with SUCCESSOR[t], and MTP module k drafts the successor of READS[k - 1][t] where it
    stands for token t, so which drafts are accepted (none, some, all) follows from the tokens alone.

    Weights ~ N(0, 0.02^2) everywhere (attention and MLPs do shift every logit with the context), plus:
    embedding rows e_t + noise, so the residual stream carries e_t; the head maps e_t to SUCCESSOR[t]
    with a logit margin of about sqrt(E) = 5.7 nats, far beyond the noise (~0.1) and any floating-point
    path. DeepSeek modules: eh_proj's embedding half maps enorm(e_t) to e_{READS[k][t]}. Parallel head k
    (predicting t_{i+1+k} from h^0 ~ e_{t_i}): its MLP replaces e_t by e_f, f = READS[k] of the k-th
    successor of t, one SwiGLU unit per token."""
    model = make_model(config, seed, 0.02)
    vocab, root = config.vocab_size, config.hidden_size**0.5
    tokens = np.arange(vocab)
    one_hot = np.eye(vocab, config.hidden_size)  # [V, E]
    add(model.embed_tokens.embedding, tokens, one_hot)  # [V, E]
    add(model.lm_head.kernel, (tokens, SUCCESSOR), 1.0)  # [E, V]
    silu = root / (1 + np.exp(-root))  # one SwiGLU unit's gate at input root
    ahead = tokens
    for k, module in enumerate(model.mtp):
        if config.mtp_style == "deepseek":  # concat(enorm(embed), hnorm(h)): rows [0, E) read the embedding
            add(module.eh_proj.kernel, (tokens, READS[k]), 4 / root)  # [2E, E]
            continue
        ahead = SUCCESSOR[ahead]  # the token head k + 1 stands for at position i: t_{i+1+k}
        # gate_up_proj [E, 2I] interleaved: column 2i is unit i's gate, 2i + 1 its up
        add(module.mlp.gate_up_proj.kernel, (tokens, 2 * tokens), 1.0)  # unit t's gate opens for e_t
        add(module.mlp.gate_up_proj.kernel, (tokens, 2 * tokens + 1), 1 / root)
        add(module.mlp.down_proj.kernel, tokens, (2 * one_hot[READS[k][ahead]] - one_hot) * root / silu)  # [I, E]
    return model


def main_twin(model):
    """A DeepSeek-style model with `model`'s main weights and attention: plain decoding reads the main model
    only, so it decodes exactly as `model` does, with the DeepSeek-style compile."""
    twin = make_model(CFG.replace(attention_impl=model.config.attention_impl), 0, 0.0)
    nnx.update(twin, nnx.state(model, MAIN_PARAMS))
    return twin


def with_impl(model, impl: str):
    """`model`'s weights in a model whose cache attention is `attention_impl=impl`."""
    if model.config.attention_impl == impl:
        return model
    twin = make_model(model.config.replace(attention_impl=impl), 0, 0.0)
    nnx.update(twin, nnx.state(model, nnx.Param))
    return twin


# ---------------------------------------------------------------------------------------------
# The no-cache draft oracle (fixed shapes [3, W]: one compile per model style)


@nnx.jit
def _depth_logits(model, tokens):
    """Every MTP depth over whole sequences, no cache: D arrays [B, W, V] (depth k, row i predicts t_{i+k+1})."""
    _, hidden = model.forward_full(tokens)
    return mtp_forward_full(model, hidden, tokens)


@nnx.jit
def _main_h0(model, tokens):
    return initial_hidden(model, model.forward_full(tokens)[1])


@nnx.jit
def _module_full(model, hidden, tokens):
    """MTP module 1 over whole sequences from position 0 with an empty cache: (logits, chained hidden)."""
    module, batch, num = model.mtp[0], *tokens.shape
    logits, chained, _ = module(
        hidden,
        tokens,
        sequence_positions(batch, num),
        module.init_cache(batch, num),
        embed=model.embed,
        head=model.head,
    )
    return logits, chained


def oracle_drafts(model, method: str, tokens: np.ndarray, lengths: np.ndarray, drafts: np.ndarray) -> np.ndarray:
    """Greedy drafts [B, K] recomputed with no cache over the committed tokens (`tokens[b, :lengths[b]]`).

    vanilla / parallel: depth k at position L - 2 over the committed sequence extended with the drafts
    (vanilla's depth k reads d_1 .. d_{k-1} as its token inputs). eagle: module 1 over the committed
    sequence, then the chained hidden state and the next draft appended at the end and the whole sequence
    re-run, once per draft.
    """
    batch, k_max = drafts.shape
    rows = np.arange(batch)
    seq = np.zeros((batch, W), np.int32)
    seq[:, :S] = tokens
    for b in rows:
        seq[b, lengths[b] : lengths[b] + k_max] = drafts[b]
    if method != "eagle":
        logits = _depth_logits(model, jnp.asarray(seq))
        return np.stack([np.asarray(logits[j])[rows, lengths - 2].argmax(-1) for j in range(k_max)], axis=1)
    h0 = np.asarray(_main_h0(model, jnp.asarray(seq)))  # causal: positions <= L - 2 see committed tokens only
    hidden, module_tokens = np.zeros_like(h0), np.zeros_like(seq)
    for b in rows:
        hidden[b, : lengths[b] - 1] = h0[b, : lengths[b] - 1]
        module_tokens[b, : lengths[b] - 1] = seq[b, 1 : lengths[b]]  # position i reads t_{i+1}
    out = []
    for j in range(k_max):
        logits, chained = (np.asarray(x) for x in _module_full(model, jnp.asarray(hidden), jnp.asarray(module_tokens)))
        at = lengths - 2 + j  # the last position run: it predicts the draft for position L + j
        out.append(logits[rows, at].argmax(-1))
        hidden[rows, at + 1] = chained[rows, at]  # the chained hidden stands in for h^0 one position on
        module_tokens[rows, at + 1] = drafts[:, j]
    return np.stack(out, axis=1)


# ---------------------------------------------------------------------------------------------
# Driving the jitted step by hand


@functools.partial(jax.jit, static_argnames="margin")
def _poison(state, margin: int = 0):
    """NaN in every cache slot past what a row's caches hold (positions 0 .. L - 2; for the MTP caches
    0 .. L - 2 - margin), and in the entries of vanilla's hidden window that stand for positions before 0."""
    draft, window = state.draft, state.draft.hidden_window.shape[1]
    positions = state.lengths[:, None] - 1 - window + jnp.arange(window)[None, :]  # [B, W]
    draft = draft.replace(
        caches=fill_stale(draft.caches, state.lengths - 1 - margin, jnp.nan),
        hidden_window=jnp.where((positions < 0)[..., None], jnp.nan, draft.hidden_window),
    )
    return state.replace(cache=fill_stale(state.cache, state.lengths - 1, jnp.nan), draft=draft)


def _snapshot(state) -> dict[str, np.ndarray]:
    return {
        k: np.array(v)
        for k, v in jax.device_get(
            dict(tokens=state.tokens, lengths=state.lengths, done=state.done, drafts=state.draft.tokens)
        ).items()
    }


def drive(model, sp: SpeculativeConfig, prompts, max_new, *, poison: bool = False, stop_tokens=(), schedule=None):
    """Prefill, then `DecodeEngine.step` until every row is done; returns the final state and a snapshot per step
    boundary (after prefill and after each step). With `poison`, stale cache slots are NaN before each step;
    for vanilla also its modules' last K - 1 live slots (computed from drafts, the window recomputes them)
    and its window's entries before position 0. `schedule`: (num_drafts, draft_next) of each step, cycled
    (`DecodeEngine.step_with_output`), instead of full steps."""
    engine = DecodeEngine(model, sp)
    steps = None if schedule is None else itertools.cycle(schedule)
    state, padded = engine.init_state(prompts, max_new_tokens=max_new, max_length=S, stop_tokens=list(stop_tokens))
    state = engine.prefill(state, padded)
    trace = [_snapshot(state)]
    while not trace[-1]["done"].all():
        if poison:
            state = _poison(state, margin=sp.num_speculative_tokens - 1 if sp.method == "vanilla" else 0)
            assert np.isnan(np.asarray(jax.tree.leaves(state.cache)[0])).any()
            assert all(np.isnan(np.asarray(jax.tree.leaves(c)[0])).any() for c in state.draft.caches)
        if steps is None:
            state = engine.step(state)
        else:
            k, draft_next = next(steps)
            state, _ = engine.step_with_output(state, num_drafts=k, draft_next=draft_next)
        trace.append(_snapshot(state))
    return state, trace


def generated(state, prompts) -> list[list[int]]:
    tokens, lengths = jax.device_get((state.tokens, state.lengths))
    return [tokens[b, len(p) : lengths[b]].tolist() for b, p in enumerate(prompts)]


# ---------------------------------------------------------------------------------------------
# Qwen3.5-shaped hybrid models (`test_hybrid_speculative`, `test_hybrid_serving`): two Gated DeltaNet layers
# (`ModelConfig.layer_types`, a `RecurrentCache` each) then one gated full-attention layer, zero-centred norms,
# q/k norms, partial rotary; one MTP module (eagle chains it). The MoE twin routes by softmax over 4 experts
# (2 per token) beside a sigmoid-gated shared expert.

HYBRID = CFG.replace(
    num_hidden_layers=3,
    layer_types=("linear_attention", "linear_attention", "full_attention"),
    linear_num_key_heads=1,
    linear_num_value_heads=2,
    linear_key_head_dim=8,
    linear_value_head_dim=8,
    attn_output_gate=True,
    use_qk_norm=True,
    rms_norm_unit_offset=True,
    partial_rotary_factor=0.25,
    num_nextn_predict_layers=1,
)
HYBRID_MOE = HYBRID.replace(
    ffn_type="moe",
    scoring_func="softmax",
    shared_expert_gate=True,
    shared_expert_intermediate_size=32,
    n_shared_experts=1,
    n_routed_experts=4,
    num_experts_per_tok=2,
    moe_intermediate_size=16,
    first_k_dense_replace=0,
)
HYBRID_CONFIGS = {"dense": HYBRID, "moe": HYBRID_MOE}


def hybrid_scripted(config: ModelConfig, seed: int):
    """`scripted` for a hybrid config; a MoE's routers get weights ~ N(0, 1) (make_model's norm-like ones would
    score every expert alike), so tokens take different experts while the script still decides the tokens."""
    model = scripted(config, seed)
    rng = np.random.default_rng(seed + 100)
    for layer in model.layers:
        if config.ffn_type == "moe":
            router = layer.mlp.gate.weight
            router.set_value(jnp.asarray(rng.normal(0.0, 1.0, router.get_value().shape), jnp.float32))
    return model


def recurrent_states(cache) -> list[tuple[np.ndarray, np.ndarray]]:
    """(state, conv) of every `RecurrentCache` of a main-model cache (unstacked layers), in layer order, on the host."""
    from mtp_jax.cache import RecurrentCache

    return [(np.array(c.state), np.array(c.conv)) for c in cache if isinstance(c, RecurrentCache)]


def memoryless(model):
    """A copy of a hybrid `model` whose Gated DeltaNets remember nothing: a log decay g = -50 softplus(a + 30)
    (about -1500: the state is multiplied by exactly 0 at every token) and a causal conv that reads the current
    token only. Same graph, so its programs are shared; for short calls only (T <= RECURRENT_MAX_TOKENS: the
    chunked form's exponentials of such cumulative decays overflow)."""
    twin = nnx.clone(model)
    for layer in twin.layers:
        if layer.recurrent:
            mixer = layer.linear_attn
            mixer.A_log.set_value(jnp.full_like(mixer.A_log.get_value(), np.log(50.0)))
            mixer.dt_bias.set_value(jnp.full_like(mixer.dt_bias.get_value(), 30.0))
            mixer.conv1d.weight.set_value(mixer.conv1d.weight.get_value().at[..., :-1].set(0.0))
    return twin
