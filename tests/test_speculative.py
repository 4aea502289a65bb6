"""Speculative decoding (`docs/MTP_SPEC.md`): lossless greedy and sampling, cached drafts == a no-cache oracle,
rollback under NaN-poisoned stale slots, stops inside a block, capacity, relaxed acceptance, fixed shapes,
metrics and impossible requests.

One model configuration (vocab 8, D = 3) and one capacity S serve every test, so each (method, K) compiles
once. Two kinds of weights: random (large enough to matter; acceptance is rare) and scripted (`scripted`:
the main model runs through two cycles and each MTP module is wrong for chosen tokens, by construction
with margins of nats), so steps that accept nothing, some and all of the drafts occur on every CPU, and
every situation a test needs (a stop token accepted as a draft, a cap met inside a block) is built,
not hoped for.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.monitoring
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from mtp_jax.cache import fill_stale
from mtp_jax.config import ModelConfig
from mtp_jax.decode.acceptance import Target, accept
from mtp_jax.decode.drafters import SpeculativeConfig
from mtp_jax.decode.engine import DecodeEngine
from mtp_jax.decode.generation import generate, stream
from mtp_jax.decode.metrics import SpecMetrics, SpeculativeMetrics
from mtp_jax.decode.sampling import SamplingParams, SamplingState, target_probs
from mtp_jax.model import init_model, sequence_positions
from mtp_jax.mtp import MAIN_PARAMS, initial_hidden, mtp_forward_full, shift_left

CFG = ModelConfig(vocab_size=8, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                  num_key_value_heads=1, head_dim=16, max_position_embeddings=64, num_nextn_predict_layers=3)
D, V = CFG.num_nextn_predict_layers, CFG.vocab_size
S = 40  # the cache capacity of every generation here
W = S + 4  # oracle sequence width: committed tokens plus up to 4 drafts
THINK, END_THINK = 6, 7  # `<think>`, `</think>`
CYCLES = [[1, 2, 3, 1, 4, 2, 5, 3], [6, 7, 0, 6, 0, 7]]  # prompt material: tokens 1..5, and 0, 6, 7
PROMPTS = [[6, 7, 0, 6], [1, 2, 3, 1, 4, 2, 5, 3, 1], [5]]  # lengths 4, 9, 1 (one prompt bucket); B = 3
MAX_NEW = [25, 20, 30]
GRID = ([("eagle", k) for k in range(1, 5)] + [("vanilla", k) for k in range(1, D + 1)]
        + [("parallel", k) for k in range(1, D + 1)])
# The cache attention of every model call: on a GPU `attention_impl="auto"` picks the Pallas kernel, so
# what holds for the reference must hold for the kernel too (in Pallas' interpreter here).
IMPLS = ["reference", "pallas_interpret"]


def spec(method: str, k: int, **kwargs) -> SpeculativeConfig:
    """Every config names the think tokens (relaxed acceptance stays off unless asked): with the feature
    off, naming them must change nothing."""
    return SpeculativeConfig(method=method, num_speculative_tokens=k, think_start_token_id=THINK,
                             think_end_token_id=END_THINK, **kwargs)


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


@pytest.fixture(scope="module")
def models():
    """{style: {"random": model, "scripted": model}}."""
    parallel = CFG.replace(mtp_style="parallel")
    return {"deepseek": {"random": make_model(CFG, 1, 0.3), "scripted": scripted(CFG, 2)},
            "parallel": {"random": make_model(parallel, 3, 0.3), "scripted": scripted(parallel, 4)}}


@pytest.fixture(scope="module")
def plain(models):
    """plain(style, name, impl): plain greedy decoding of PROMPTS by a model, what speculation must
    reproduce (computed once each)."""

    @functools.cache
    def run(style_: str, name: str, impl: str = "reference"):
        model = main_twin(with_impl(models[style_][name], impl))
        return generate(model, PROMPTS, max_new_tokens=MAX_NEW, max_length=S, stop_tokens=[])

    return run


# ---------------------------------------------------------------------------------------------
# No-cache oracles (fixed shapes [3, W]: one compile per model style)


@nnx.jit
def _main_logits(model, tokens):
    return model.forward_full(tokens)[0]


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
    logits, chained, _ = module(hidden, tokens, sequence_positions(batch, num), module.init_cache(batch, num),
                                embed=model.embed, head=model.head)
    return logits, chained


@nnx.jit
def _fresh_caches(model, tokens):
    """The main cache and eagle's module cache recomputed from scratch over committed tokens [B, S]."""
    batch, module = tokens.shape[0], model.mtp[0]
    positions = sequence_positions(batch, S)
    _, hidden, main = model(tokens, positions, model.init_cache(batch, S))
    _, _, module_cache = module(initial_hidden(model, hidden), shift_left(tokens, 1), positions,
                                module.init_cache(batch, S), embed=model.embed, head=model.head)
    return main, module_cache


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
        seq[b, lengths[b]: lengths[b] + k_max] = drafts[b]
    if method != "eagle":
        logits = _depth_logits(model, jnp.asarray(seq))
        return np.stack([np.asarray(logits[j])[rows, lengths - 2].argmax(-1) for j in range(k_max)], axis=1)
    h0 = np.asarray(_main_h0(model, jnp.asarray(seq)))  # causal: positions <= L - 2 see committed tokens only
    hidden, module_tokens = np.zeros_like(h0), np.zeros_like(seq)
    for b in rows:
        hidden[b, : lengths[b] - 1] = h0[b, : lengths[b] - 1]
        module_tokens[b, : lengths[b] - 1] = seq[b, 1: lengths[b]]  # position i reads t_{i+1}
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
    draft = draft.replace(caches=fill_stale(draft.caches, state.lengths - 1 - margin, jnp.nan),
                          hidden_window=jnp.where((positions < 0)[..., None], jnp.nan, draft.hidden_window))
    return state.replace(cache=fill_stale(state.cache, state.lengths - 1, jnp.nan), draft=draft)


def _snapshot(state) -> dict[str, np.ndarray]:
    return {k: np.array(v) for k, v in jax.device_get(dict(
        tokens=state.tokens, lengths=state.lengths, done=state.done, drafts=state.draft.tokens)).items()}


def drive(model, sp: SpeculativeConfig, prompts, max_new, *, poison: bool = False, stop_tokens=()):
    """Prefill, then `DecodeEngine.step` until every row is done; returns the final state and a snapshot per step
    boundary (after prefill and after each step). With `poison`, stale cache slots are NaN before each step;
    for vanilla also its modules' last K - 1 live slots (computed from drafts, the window recomputes them)
    and its window's entries before position 0."""
    engine = DecodeEngine(model, sp)
    state, padded = engine.init_state(prompts, max_new_tokens=max_new, max_length=S, stop_tokens=list(stop_tokens))
    state = engine.prefill(state, padded)
    trace = [_snapshot(state)]
    while not trace[-1]["done"].all():
        if poison:
            state = _poison(state, margin=sp.num_speculative_tokens - 1 if sp.method == "vanilla" else 0)
            assert np.isnan(np.asarray(jax.tree.leaves(state.cache)[0])).any()
            assert all(np.isnan(np.asarray(jax.tree.leaves(c)[0])).any() for c in state.draft.caches)
        state = engine.step(state)
        trace.append(_snapshot(state))
    return state, trace


def observed_accepts(trace, k_max: int) -> list[tuple[int, int, int]]:
    """(step, row, drafts accepted and committed) for each row active in each step, read off the trace:
    greedy acceptance is the run of leading drafts equal to the committed block."""
    out = []
    for step, (before, after) in enumerate(zip(trace[:-1], trace[1:], strict=True)):
        for b in np.flatnonzero(~before["done"]):
            start, num = before["lengths"][b], after["lengths"][b] - before["lengths"][b]
            block = after["tokens"][b, start: start + num]
            matches = block[: k_max] == before["drafts"][b, : len(block[: k_max])]
            out.append((step, int(b), int(np.cumprod(matches).sum())))
    return out


def generated(state, prompts) -> list[list[int]]:
    tokens, lengths = jax.device_get((state.tokens, state.lengths))
    return [tokens[b, len(p): lengths[b]].tolist() for b, p in enumerate(prompts)]


def has_zero_partial_full(histogram, k_max: int) -> bool:
    return histogram[0] > 0 and histogram[k_max] > 0 and (k_max == 1 or sum(histogram[1:k_max]) > 0)


# ---------------------------------------------------------------------------------------------
# Lossless greedy; cached drafts == no-cache oracle; NaN in stale slots changes nothing; counters


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("method, k", GRID)
def test_greedy_is_lossless_and_drafts_equal_the_no_cache_oracle(models, plain, method, k, impl):
    """Both models, with the reference attention and with the kernel, stale cache slots NaN before every
    step: the tokens and logprobs equal plain greedy decoding, the drafts at every step boundary equal the
    no-cache oracle, and the counters equal the acceptances read off the committed blocks. On the scripted
    model steps accepting 0, some and all drafts all occur. The think tokens are named with relaxed
    acceptance off, and row 0's prompt ends in `<think>`: nothing changes."""
    sp = spec(method, k)
    for name, model in models[style(method)].items():
        state, trace = drive(with_impl(model, impl), sp, PROMPTS, MAX_NEW, poison=True)
        expected = plain(style(method), name, impl)
        assert generated(state, PROMPTS) == expected.tokens, name
        assert [len(t) for t in expected.tokens] == MAX_NEW
        logprobs = np.asarray(state.logprobs)
        for b, prompt in enumerate(PROMPTS):
            np.testing.assert_allclose(logprobs[b, len(prompt): len(prompt) + MAX_NEW[b]], expected.logprobs[b],
                                       atol=2e-5)
        for step, snap in enumerate(trace):
            active = ~snap["done"]
            want = oracle_drafts(model, method, snap["tokens"], snap["lengths"], snap["drafts"])
            np.testing.assert_array_equal(snap["drafts"][active], want[active], err_msg=f"{name}, step {step}")

        histogram = np.zeros((3, k + 1), int)
        for _, b, n in observed_accepts(trace, k):
            histogram[b, n] += 1
        m = jax.device_get(state.metrics)
        np.testing.assert_array_equal(m.accepted_length_histogram, histogram)
        np.testing.assert_array_equal(m.num_steps, histogram.sum(1))
        np.testing.assert_array_equal(m.num_drafts, k * histogram.sum(1))
        np.testing.assert_array_equal(m.num_accepted, (histogram * np.arange(k + 1)).sum(1))
        np.testing.assert_array_equal(m.accepted_per_position,
                                      [[histogram[b, j + 1:].sum() for j in range(k)] for b in range(3)])
        # Tokens: 1 from prefill, then a + 1 per step, except a last step cut by max_new_tokens.
        full = 1 + m.num_steps + m.num_accepted
        assert np.all((np.asarray(MAX_NEW) == full) | (np.asarray(MAX_NEW) == full - 1)), full
        if name == "scripted":  # by construction: steps accept none, some and all drafts; speculation pays off
            assert has_zero_partial_full(histogram.sum(0), k), histogram
            assert len(trace) - 1 < max(MAX_NEW) - 1


# ---------------------------------------------------------------------------------------------
# Stops inside a block, capacity


def test_stop_token_accepted_as_a_draft_ends_its_row_there(models, plain):
    """Scripted model, eagle K = 3. Row 0 runs on the cycle 7 -> 0 -> 6, where module 1 is always right,
    so its first step accepts the drafts [0, 6, 7]; rows 1, 2 run on 1..5 and never emit 6. Stop token 6,
    the second accepted draft of that block, ends row 0 right after it (no third draft, no bonus) while
    the others go on. Row 1 meanwhile meets max_new_tokens inside a block (no bonus: a + 1 > the cut)."""
    model, sp, k = models["deepseek"]["scripted"], spec("eagle", 3), 3
    free = plain("deepseek", "scripted").tokens
    stop = 6
    assert free[0][:5] == [7, 0, 6, 7, 0] and stop not in free[1] + free[2]  # the construction
    state, trace = drive(model, sp, PROMPTS, MAX_NEW)
    m = jax.device_get(state.metrics)
    assert trace[1]["lengths"][0] - trace[0]["lengths"][0] == k + 1 and list(trace[0]["drafts"][0]) == [0, 6, 7]
    assert MAX_NEW[1] == m.num_steps[1] + m.num_accepted[1], (m.num_steps, m.num_accepted)
    state, trace = drive(model, sp, PROMPTS, MAX_NEW, stop_tokens=[stop])
    cut = free[0].index(stop) + 1
    assert generated(state, PROMPTS) == [free[0][:cut], free[1], free[2]]
    # The step that ended row 0 committed the stop token as an accepted draft, and no bonus after it.
    last = next(s for s in range(len(trace) - 1) if trace[s + 1]["done"][0])
    num = trace[last + 1]["lengths"][0] - trace[last]["lengths"][0]
    assert (last, num) == (0, 2) and trace[0]["drafts"][0, num - 1] == stop
    assert not trace[last + 1]["done"][1:].any()
    result = generate(model, PROMPTS, speculative=sp, max_new_tokens=MAX_NEW, max_length=S, stop_tokens=[stop])
    assert result.tokens == [free[0][:cut], free[1], free[2]]
    assert result.finish_reasons == ["stop", "length", "length"]
    assert result.metrics == SpeculativeMetrics.from_counters(state.metrics)  # the loop counts as the steps do
    assert result.num_steps == len(trace) - 1


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("method, k", [("eagle", 1), ("eagle", 4), ("eagle", 8), ("vanilla", 3)])
def test_capacity_ends_rows_exactly_and_live_cache_entries_stay_intact(models, method, k, impl):
    """Prompts K and 1 tokens short of S get exactly K and 1 tokens, == plain greedy, with the reference
    attention and with the kernel. Every row runs to the capacity while the verify and draft windows reach
    past S (the verify attention then sees lengths beyond S; stale slots NaN before each step); the live
    cache entries then equal a recompute from scratch, so no write was clamped onto them."""
    model, sp = with_impl(models["deepseek"]["scripted"], impl), spec(method, k)
    prompts = [(CYCLES[0] * 5)[: S - k], (CYCLES[1] * 7)[: S - 1], [5]]
    expected = generate(model, prompts, max_new_tokens=100, max_length=S, stop_tokens=[])
    assert [len(t) for t in expected.tokens] == [k, 1, S - 1] and expected.finish_reasons == ["capacity"] * 3
    state, _ = drive(model, sp, prompts, 100, poison=True)
    assert generated(state, prompts) == expected.tokens
    np.testing.assert_array_equal(state.lengths, [S] * 3)  # the caches hold positions 0 .. S - 2
    main, module = _fresh_caches(model, state.tokens)
    fresh = [(main, state.cache)] + ([(module, state.draft.caches[0])] if method == "eagle" else [])
    for want, got in fresh:
        for leaf_want, leaf_got in zip(jax.tree.leaves(want), jax.tree.leaves(got), strict=True):
            np.testing.assert_allclose(np.asarray(leaf_got)[:, : S - 1], np.asarray(leaf_want)[:, : S - 1],
                                       atol=1e-5)


# ---------------------------------------------------------------------------------------------
# Acceptance: lossless sampling, zero-probability drafts, no NaN


def _log(p):
    with np.errstate(divide="ignore"):
        return np.log(np.asarray(p, np.float64)).astype(np.float32)


def chi_square_ok(counts: np.ndarray, probs: np.ndarray, z: float = 4.5) -> tuple[bool, str]:
    """Pearson's chi-square of `counts` against `probs`: no count where the probability is 0, and the
    statistic below the upper quantile at normal deviate z (Wilson-Hilferty; z = 4.5 is about 3e-6).
    Cells expected below 5 are pooled."""
    counts, probs = np.asarray(counts, float).ravel(), np.asarray(probs, float).ravel()
    if counts[probs == 0].sum():
        return False, f"{counts[probs == 0].sum()} samples where the target has probability 0"
    n = counts.sum()
    expected = n * probs
    big = expected >= 5
    obs = np.append(counts[big], counts[~big & (probs > 0)].sum())
    exp = np.append(expected[big], expected[~big & (probs > 0)].sum())
    obs, exp = obs[exp > 0], exp[exp > 0]
    stat, df = float(((obs - exp) ** 2 / exp).sum()), len(exp) - 1
    bound = df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3
    return stat < bound, f"chi-square {stat:.1f} vs bound {bound:.1f} (df {df}, n {n:.0f})"


def emitted(num_accepted: np.ndarray, token: np.ndarray, drafts: np.ndarray) -> np.ndarray:
    """The tokens a step emits, [B, K + 1], -1 past the a + 1 emitted."""
    k_max = drafts.shape[1]
    index = np.arange(k_max + 1)[None, :]
    padded = np.concatenate([drafts, np.zeros_like(drafts[:, :1])], axis=1)
    out = np.where(index < num_accepted[:, None], padded, token[:, None])
    return np.where(index <= num_accepted[:, None], out, -1)


@functools.cache
def jit_accept(sp: SpeculativeConfig):
    """`accept` jitted once per config (and shapes)."""
    return jax.jit(lambda logits, drafts, q, sampling, *rest: accept(sp, Target.from_logits(logits, sampling), drafts,
                                                                      q, sampling, *rest))


def with_uniform(monkeypatch, value: float, sp: SpeculativeConfig):
    """`accept` under a fresh jit with every uniform draw of the acceptance test forced to `value`."""
    monkeypatch.setattr(jax.random, "uniform", lambda key, *args, **kwargs: jnp.full((), value, jnp.float32))
    return jax.jit(lambda logits, drafts, q, sampling, *rest: accept(sp, Target.from_logits(logits, sampling), drafts,
                                                                      q, sampling, *rest))


N_ROWS, SAMPLE_SPEC = 20000, spec("eagle", 2, draft_sampling="sample")  # one compile of `accept` for both tests
P = np.array([[0.5, 0.2, 0.2, 0.1, 0.0], [0.1, 0.0, 0.3, 0.3, 0.3], [0.25, 0.25, 0.0, 0.25, 0.25]])  # p_0..p_2
Q = np.array([[0.1, 0.6, 0.0, 0.2, 0.1], [0.3, 0.3, 0.3, 0.1, 0.0]])  # q_1, q_2: zeros where p has mass


def _rows(**kwargs) -> SamplingState:
    return SamplingState.from_params([SamplingParams(seed=s, **kwargs) for s in range(N_ROWS)])


def _draw(probs: np.ndarray, rng) -> np.ndarray:
    """One token per row from probs [B, V] (inverse CDF)."""
    cdf = np.cumsum(probs / probs.sum(-1, keepdims=True), axis=-1)
    return np.minimum((rng.random((len(probs), 1)) > cdf).sum(-1), probs.shape[-1] - 1).astype(np.int32)


@pytest.mark.parametrize("draft_sampling", ["sample", "greedy"])
def test_accept_emits_the_target_distribution(draft_sampling):
    """20000 rows with distinct seeds, drafts drawn from q (or fixed greedy drafts, q one-hot): the first
    emitted token follows p_0, the second (rows that accepted d_1) p_1, the bonus (rows that accepted both)
    p_2; d_1 is accepted at the rate sum(min(p_0, q_1)); drafts with p = 0 are never accepted."""
    rng = np.random.default_rng(0)
    logits = jnp.asarray(np.broadcast_to(_log(P), (N_ROWS, 3, 5)))
    if draft_sampling == "sample":
        drafts = np.stack([_draw(np.broadcast_to(q, (N_ROWS, 5)), rng) for q in Q], axis=1)
        q, sp = jnp.asarray(np.broadcast_to(Q, (N_ROWS, 2, 5)), jnp.float32), SAMPLE_SPEC
        rate = np.minimum(P[0], Q[0]).sum()
    else:  # half the rows draft (0, 2), half (0, 1), and p_1(1) = 0
        drafts = np.where(np.arange(N_ROWS)[:, None] % 2, np.int32([0, 2]), np.int32([0, 1]))
        q, sp = jnp.zeros((N_ROWS, 2, 0), jnp.float32), spec("eagle", 2)
        rate = P[0, 0]
    num_accepted, token = jax.device_get(jit_accept(sp)(logits, jnp.asarray(drafts), q, _rows(temperature=1.0),
                                                        jnp.full((N_ROWS,), 5, jnp.int32), jnp.zeros((N_ROWS,), bool)))
    out = emitted(num_accepted, token, drafts)
    for j, rows in enumerate([num_accepted >= 0, num_accepted >= 1, num_accepted == 2]):
        ok, message = chi_square_ok(np.bincount(out[rows, j], minlength=5), P[j])
        assert ok, f"emitted token {j}: {message}"
    accepted = (num_accepted >= 1).mean()
    assert abs(accepted - rate) < 4.5 * math.sqrt(rate * (1 - rate) / N_ROWS), (accepted, rate)
    zero = np.concatenate([P[0][drafts[:, :1]] == 0, P[1][drafts[:, 1:]] == 0], axis=1)  # [B, K]: p(d_j) = 0
    assert zero.any() and not np.any(zero & (np.arange(2)[None, :] < num_accepted[:, None]))


def test_zero_probability_draft_is_never_accepted_even_for_a_zero_uniform(monkeypatch):
    """Every uniform draw forced to exactly 0 (so `u * q < p` holds for any p > 0): drafts with target
    probability 0 (outside top-k, not the greedy argmax) are rejected whatever q(d), a draft with
    probability ~1e-6 is accepted."""
    logits = jnp.asarray(np.tile(np.float32([4.0, 3.0, 2.0, 1.0, -10.0]), (4, 2, 1)))  # [B, K + 1, V]
    sampling = SamplingState.from_params([SamplingParams(temperature=1.0, top_k=2), SamplingParams(),
                                          SamplingParams(temperature=1.0, top_k=4),
                                          SamplingParams(temperature=1.0)])
    drafts = jnp.int32([[2], [1], [4], [4]])  # outside top-2; not the argmax; outside top-4; p ~ 1e-6
    q = jnp.asarray(np.float32([[0, 0, 1, 0, 0], [0, 0.5, 0, 0, 0.5], [0.1, 0.1, 0.1, 0.4, 0.3],
                                [0, 0, 0, 0, 1]])[:, None, :])
    accept_zero = with_uniform(monkeypatch, 0.0, spec("eagle", 1, draft_sampling="sample"))
    num_accepted, token = accept_zero(logits, drafts, q, sampling, jnp.full((4,), 3), jnp.zeros((4,), bool))
    np.testing.assert_array_equal(num_accepted, [0, 0, 0, 1])
    token = np.asarray(token)
    assert token[0] in (0, 1) and token[1] == 0 and token[2] in (0, 1, 2, 3)


def test_p_equal_to_q_with_zeros_gives_no_nan(monkeypatch):
    """q = p (temperature 0.7 and top-3 leave zeros in both): every draft is accepted and the bonus is a
    token of p_K. A rejection forced by u = 1 leaves max(0, p - q) = 0 everywhere: the row still emits a
    token of p, never NaN or a division by zero."""
    rng = np.random.default_rng(1)
    logits = jnp.asarray(rng.normal(0, 2, (N_ROWS, 3, 5)), jnp.float32)
    sampling = _rows(temperature=0.7, top_k=3)
    p = np.asarray(jax.jit(target_probs)(logits, sampling), np.float64)  # [B, K + 1, V]
    drafts = np.stack([_draw(p[:, j], rng) for j in range(2)], axis=1)
    args = (logits, jnp.asarray(drafts), jnp.asarray(p[:, :2], jnp.float32), sampling, jnp.zeros((N_ROWS,), jnp.int32),
            jnp.zeros((N_ROWS,), bool))
    for forced, expected_accepted in [(None, 2), (1.0, 0)]:
        fn = jit_accept(SAMPLE_SPEC) if forced is None else with_uniform(monkeypatch, forced, SAMPLE_SPEC)
        num_accepted, token = (np.asarray(x) for x in fn(*args))
        assert np.all(num_accepted == expected_accepted)
        assert np.all(p[np.arange(N_ROWS), num_accepted, token] > 0)


def check_sampled_generation(model, sp: SpeculativeConfig, n: int = 4096, top_k: int = 6):
    """n rows of one prompt with distinct seeds, temperature 1 and top-k, two greedy rows first: the first
    three generated tokens (one from prefill, then accepted drafts, residual samples and bonuses of
    speculative steps) follow the model's distribution, enumerated exactly; the greedy rows are greedy."""
    prompt = [3, 1, 4]
    sampling = [SamplingParams()] * 2 + [SamplingParams(temperature=1.0, top_k=top_k, seed=s) for s in range(n - 2)]
    result = generate(model, [prompt] * n, speculative=sp, max_new_tokens=3, max_length=S, stop_tokens=[],
                                  sampling=sampling)
    tokens = np.asarray(result.tokens)  # [n, 3]
    assert 0 < result.metrics.num_accepted < result.metrics.num_drafts

    def target(logits):  # temperature 1 and top-k, in numpy
        logits = np.asarray(logits, np.float64)
        kth = np.sort(logits, axis=-1)[..., -top_k][..., None]
        p = np.where(logits >= kth, np.exp(logits - logits.max(-1, keepdims=True)), 0.0)
        return p / p.sum(-1, keepdims=True)

    seqs = np.zeros((V * V + 2, W), np.int32)  # every (t_1, t_2) after the prompt, 3 rows per oracle call
    for i in range(V * V):
        seqs[i, : len(prompt) + 2] = prompt + [i // V, i % V]
    logits = np.concatenate([np.asarray(_main_logits(model, jnp.asarray(seqs[i: i + 3]))) for i in range(0, V * V, 3)])
    at1, at2, at3 = logits[0, len(prompt) - 1], logits[::V][:V, len(prompt)], logits[: V * V, len(prompt) + 1]
    greedy1 = at1.argmax()
    greedy2 = at2[greedy1].argmax()
    np.testing.assert_array_equal(tokens[:2], [[greedy1, greedy2, at3[greedy1 * V + greedy2].argmax()]] * 2)
    joint12 = target(at1)[:, None] * target(at2)  # [t_1, t_2]
    joint123 = joint12[..., None] * target(at3).reshape(V, V, V)  # [t_1, t_2, t_3]
    sampled = tokens[2:]
    ok, message = chi_square_ok(np.bincount(sampled[:, 0] * V + sampled[:, 1], minlength=V * V), joint12)
    assert ok, f"(t_1, t_2): {message}"
    ok, message = chi_square_ok(np.bincount((sampled[:, 0] * V + sampled[:, 1]) * V + sampled[:, 2],
                                            minlength=V ** 3), joint123)
    assert ok, f"(t_1, t_2, t_3): {message}"


def test_sampled_generation_follows_the_target_distribution(models):
    """Drafts sampled from the MTP distribution (q carried from the draft step to the next verify)."""
    check_sampled_generation(models["deepseek"]["random"], spec("eagle", 2, draft_sampling="sample"))


# ---------------------------------------------------------------------------------------------
# Relaxed acceptance


def _relaxed_spec(delta: float = 0.2, k: int = 4) -> SpeculativeConfig:
    return spec("eagle", k, relaxed_top_n=3, relaxed_delta=delta)


def test_relaxed_acceptance_is_judged_per_row_and_per_draft_position():
    """Target at every position: p(1) = 0.4 (argmax), p(2) = 0.3 (top-3, within delta 0.2), p(3) = 0.15
    (top-3, not within delta), p(7 = </think>) = 0.1 (within delta only at position 1, where p(7) = 0.3)."""
    base = np.array([0.02, 0.4, 0.3, 0.15, 0.01, 0.01, 0.01, 0.1])
    think_end_close = np.array([0.02, 0.4, 0.15, 0.1, 0.01, 0.01, 0.01, 0.3])
    think_start_top = np.array([0.02, 0.1, 0.05, 0.01, 0.01, 0.01, 0.7, 0.1])
    end_top = np.array([0.02, 0.1, 0.05, 0.01, 0.01, 0.01, 0.1, 0.7])
    cases = [  # (thinking, temperature, drafts, target per position 0..3, expected num_accepted)
        (True, 0.0, [2, 2, 2, 2], [base] * 4, 4),  # thinking: relaxed all the way
        (False, 0.0, [2, 2, 2, 2], [base] * 4, 0),  # not thinking: strict
        (True, 0.0, [2, 7, 2, 2], [base, think_end_close, base, base], 2),  # </think> accepted: strict after
        (True, 0.0, [1, 3, 2, 2], [base] * 4, 1),  # 3 is in the top 3 but not within delta
        (True, 0.01, [2, 2, 2, 2], [base] * 4, 0),  # sampled rows never relax (p(2) ~ 0 at T = 0.01)
        (False, 0.0, [6, 2, 2, 2], [think_start_top, base, base, base], 4),  # <think> accepted: relaxed after
        (True, 0.0, [7, 2, 2, 2], [end_top, base, base, base], 1),  # </think> first: the rest strict
        (True, 0.0, [7, 2, 2, 2], [base] * 4, 0),  # </think> outside the top 3 and below 0.4 - 0.2
    ]
    thinking = jnp.asarray([c[0] for c in cases])
    sampling = SamplingState.from_params([SamplingParams(temperature=c[1]) for c in cases])
    drafts = jnp.asarray([c[2] for c in cases], jnp.int32)
    logits = jnp.asarray(np.stack([_log(np.stack(c[3] + [base])) for c in cases]))  # [B, K + 1, V]
    n = len(cases)
    num_accepted, token = jit_accept(_relaxed_spec())(logits, drafts, jnp.zeros((n, 4, 0)), sampling,
                                                      jnp.full((n,), 10), thinking)
    np.testing.assert_array_equal(num_accepted, [c[4] for c in cases])
    np.testing.assert_array_equal(np.asarray(token)[[0, 1, 2, 3, 5, 6, 7]], [1, 1, 1, 1, 1, 1, 1])


def _phases(tokens: list[int]) -> list[bool]:
    """phase[i]: thinking after tokens[:i]."""
    phase, out = False, []
    for t in tokens:
        out.append(phase)
        phase = True if t == THINK else False if t == END_THINK else phase
    return out + [phase]


def near_tie() -> object:
    """The scripted DeepSeek-style model with a near-tie after token 1: the main model puts p ~ 0.55 on its
    successor 2 and p ~ 0.43 on 3 (head weight 0.9 beside 1), and MTP module 1 drafts 3 there (it acts on
    2 where it stands for 1). Strict decoding continues 1 with 2; relaxed acceptance (top-3, delta 0.3)
    takes the draft 3 inside a thinking phase."""
    model = scripted(CFG, 2)
    root = CFG.hidden_size**0.5
    add(model.lm_head.kernel, (1, 3), 0.9)
    add(model.mtp[0].eh_proj.kernel, (1, 1), -4 / root)
    add(model.mtp[0].eh_proj.kernel, (1, 2), 4 / root)
    return model


def test_relaxed_generation_relaxes_only_thinking_positions():
    """Rows in and out of the thinking phase in one batch (row 0 thinks throughout, row 1 never, row 2's
    prompt closes its phase). Each generated token, checked against a no-cache recompute: where the row
    was thinking it is among the top-3 and within delta of the top probability, elsewhere it is the
    argmax; row 0 takes relaxed tokens (the near-tie is built in); rows that never think equal strict
    greedy."""
    model, sp = near_tie(), _relaxed_spec(0.3, k=2)
    prompts = [[THINK, 1, 2], [3, 4], [THINK, 5, END_THINK, 2]]
    result = generate(model, prompts, speculative=sp, max_new_tokens=30, max_length=S, stop_tokens=[])
    strict = generate(model, prompts, max_new_tokens=30, max_length=S, stop_tokens=[])
    seqs = np.zeros((3, W), np.int32)
    for b, (prompt, tokens) in enumerate(zip(prompts, result.tokens, strict=True)):
        seqs[b, : len(prompt) + len(tokens)] = prompt + tokens
    probs = np.asarray(jax.nn.softmax(_main_logits(model, jnp.asarray(seqs)), axis=-1))
    relaxed_tokens = in_phase = out_of_phase = 0
    for b, (prompt, tokens) in enumerate(zip(prompts, result.tokens, strict=True)):
        phases = _phases(prompt + tokens)
        for i in range(len(prompt), len(prompt) + len(tokens)):
            p, t = probs[b, i - 1], seqs[b, i]
            if phases[i]:
                assert t in np.argsort(-p)[:3] and p[t] >= p.max() - 0.3 - 1e-5, (b, i)
                relaxed_tokens += int(t != p.argmax())
            else:
                assert t == p.argmax(), (b, i)
        if not any(phases[len(prompt):]):
            assert tokens == strict.tokens[b]
        in_phase += sum(phases[len(prompt): len(prompt) + len(tokens)])
        out_of_phase += len(tokens) - sum(phases[len(prompt): len(prompt) + len(tokens)])
    assert relaxed_tokens > 0 and in_phase > 0 and out_of_phase > 0, (relaxed_tokens, in_phase, out_of_phase)
    assert result.tokens[0][:5] == [3, 4, 5, 1, 3] and strict.tokens[0][:5] == [3, 4, 5, 1, 2]


# ---------------------------------------------------------------------------------------------
# Fixed shapes, streaming, mixed greedy and sampled rows


def test_no_recompilation_across_lengths_acceptance_and_sampling(models):
    """After one warm-up, generations and streams with other weights (other acceptance patterns), lengths,
    stop tokens and greedy / sampled rows compile nothing. Streaming yields what generation returns, and
    the greedy row of a mixed batch equals plain greedy."""
    sp = spec("eagle", 3)
    by_name = models["deepseek"]
    kwargs = dict(max_new_tokens=MAX_NEW, max_length=S, stop_tokens=[])
    generate(by_name["scripted"], PROMPTS, speculative=sp, **kwargs)  # warm-up
    list(stream(by_name["scripted"], PROMPTS, speculative=sp, **kwargs))
    compiles = []

    def listener(name, _duration, **_):
        if name == "/jax/core/compile/backend_compile_duration":
            compiles.append(name)

    mixed = [SamplingParams(), SamplingParams(temperature=0.8, top_k=5, seed=3),
             SamplingParams(temperature=1.2, top_p=0.9, seed=4)]
    jax.monitoring.register_event_duration_secs_listener(listener)
    try:
        runs = []
        for name, n, stop in [("random", 1, [0]), ("scripted", 7, [3, 4]), ("random", 25, []), ("scripted", 2, [])]:
            prompts = [[2, 3], [1] * 11, [THINK, 7, 7]]
            runs.append(generate(by_name[name], prompts, speculative=sp, max_new_tokens=n, max_length=S,
                                             stop_tokens=stop, sampling=mixed))
            pieces = list(stream(by_name[name], PROMPTS, speculative=sp, max_new_tokens=[n, 3, 9], max_length=S,
                                             stop_tokens=stop))
        assert not compiles, f"{len(compiles)} compiles after warm-up"
    finally:
        jax.monitoring.clear_event_listeners()
    streamed = [sum((step[b] for step in pieces), []) for b in range(3)]
    assert streamed == generate(by_name["scripted"], PROMPTS, speculative=sp, max_new_tokens=[2, 3, 9], max_length=S,
                                            stop_tokens=[]).tokens
    # The greedy row of a mixed batch still equals plain greedy.
    greedy = generate(by_name["random"], [[2, 3], [1] * 11, [THINK, 7, 7]], max_new_tokens=25, max_length=S,
                      stop_tokens=[])
    assert runs[2].tokens[0] == greedy.tokens[0]
    assert [len(t) for t in runs[2].tokens] == [25] * 3


# ---------------------------------------------------------------------------------------------
# Metrics


def test_metrics_by_hand():
    """K = 4. Row 0 accepts 0, 2 and 4 drafts in three steps, row 1 accepts 1 in one step."""
    metrics = SpecMetrics(num_steps=jnp.int32([3, 1]), num_drafts=jnp.int32([12, 4]), num_accepted=jnp.int32([6, 1]),
                          accepted_per_position=jnp.int32([[2, 2, 1, 1], [1, 0, 0, 0]]),
                          accepted_length_histogram=jnp.int32([[1, 0, 1, 0, 1], [0, 1, 0, 0, 0]]))
    row0 = SpeculativeMetrics.from_counters(jax.tree.map(lambda x: x[:1], metrics))
    assert row0.mean_acceptance_length == 3.0
    assert row0.acceptance_rate_per_position == [2 / 3, 2 / 3, 1 / 3, 1 / 3]
    assert row0.draft_acceptance_rate == 0.5 and row0.accepted_length_histogram == [1, 0, 1, 0, 1]
    pooled = SpeculativeMetrics.from_counters(metrics)  # pooled over rows, not an average of row means (2.5)
    assert pooled.mean_acceptance_length == 1 + 7 / 4 and pooled.num_steps == 4 and pooled.num_drafts == 16
    assert pooled.acceptance_rate_per_position == [3 / 4, 2 / 4, 1 / 4, 1 / 4]
    assert pooled.accepted_length_histogram == [1, 1, 1, 0, 1]
    assert "mean acceptance length 2.75" in pooled.summary()
    assert math.isnan(SpeculativeMetrics(0, 0, 0, [0], [0, 0]).mean_acceptance_length)


# ---------------------------------------------------------------------------------------------
# Impossible requests


@pytest.mark.parametrize("style_, kwargs, message", [
    ("deepseek", dict(method="vanilla", num_speculative_tokens=4), "exceeds the model's 3 MTP modules"),
    ("parallel", dict(method="parallel", num_speculative_tokens=4), "exceeds the model's 3 MTP modules"),
    ("deepseek", dict(method="parallel", num_speculative_tokens=2), "parallel heads"),
    ("parallel", dict(method="eagle", num_speculative_tokens=2), "DeepSeek-style"),
    ("none", dict(method="eagle", num_speculative_tokens=2), "no MTP modules"),
    ("deepseek", dict(method="eagle", num_speculative_tokens=2, relaxed_top_n=9, think_start_token_id=THINK,
                      think_end_token_id=END_THINK), "relaxed_top_n"),
    ("deepseek", dict(method="eagle", num_speculative_tokens=2, think_start_token_id=8), "think_start_token_id"),
])
def test_impossible_requests_raise(models, style_, kwargs, message):
    no_mtp = CFG.replace(num_nextn_predict_layers=0)
    model = make_model(no_mtp, 0, 0.02) if style_ == "none" else models[style_]["random"]
    with pytest.raises(ValueError, match=message):
        generate(model, PROMPTS, speculative=SpeculativeConfig(**kwargs), max_new_tokens=3, max_length=S)


@pytest.mark.parametrize("kwargs, message", [
    (dict(num_speculative_tokens=0), "num_speculative_tokens"),
    (dict(num_speculative_tokens=-1), "num_speculative_tokens"),
    (dict(method="medusa"), "method"),
    (dict(draft_sampling="typical"), "draft_sampling"),
    (dict(relaxed_top_n=3), "think_start_token_id"),
    (dict(relaxed_top_n=3, relaxed_delta=-0.1, think_start_token_id=1, think_end_token_id=2), "relaxed_delta"),
])
def test_bad_speculative_config_raises(kwargs, message):
    with pytest.raises(ValueError, match=message):
        SpeculativeConfig(**kwargs)


def test_stream_returns_the_result_of_generate(models):
    """The stream's return value (StopIteration.value) carries the tokens, finish reasons, verify steps and
    metrics that `generate` returns for the same request."""
    model, sp = models["deepseek"]["scripted"], spec("eagle", 3)
    kwargs = dict(max_new_tokens=MAX_NEW, max_length=S, stop_tokens=[6])
    steps = stream(model, PROMPTS, speculative=sp, **kwargs)
    pieces = []
    while True:
        try:
            pieces.append(next(steps))
        except StopIteration as end:
            streamed = end.value
            break
    expected = generate(model, PROMPTS, speculative=sp, **kwargs)
    assert streamed.tokens == expected.tokens == [sum((p[b] for p in pieces), []) for b in range(3)]
    assert streamed.finish_reasons == expected.finish_reasons == ["stop", "length", "length"]
    assert streamed.metrics == expected.metrics and streamed.num_steps == expected.num_steps == len(pieces) - 1


# ---------------------------------------------------------------------------------------------
# One engine: plain decoding is the step with no drafter; the oracle drafter; one normalisation


def test_plain_decoding_is_the_step_with_no_drafts(models, plain):
    """`DecodeEngine(model)` (no drafter) commits exactly one token per active row per step, the plain
    greedy tokens, and counts steps with no drafts: K = 0 in every shape."""
    model = main_twin(models["deepseek"]["scripted"])
    engine = DecodeEngine(model)
    state, padded = engine.init_state(PROMPTS, max_new_tokens=MAX_NEW, max_length=S, stop_tokens=[])
    assert state.draft.tokens.shape == (3, 0) and state.draft.caches == ()
    state = engine.prefill(state, padded)
    np.testing.assert_array_equal(state.lengths, [len(p) + 1 for p in PROMPTS])
    while not bool(np.all(state.done)):
        before = np.asarray(state.lengths) + 0  # a copy: the state is donated
        active = ~np.asarray(state.done)
        state = engine.step(state)
        np.testing.assert_array_equal(np.asarray(state.lengths) - before, active.astype(int))
    assert generated(state, PROMPTS) == plain("deepseek", "scripted").tokens
    m = jax.device_get(state.metrics)
    np.testing.assert_array_equal(m.num_steps, np.asarray(MAX_NEW) - 1)
    assert m.num_drafts.sum() == 0 and m.accepted_length_histogram.shape == (3, 1)
    assert engine.result(state, 0.0).metrics is None


@pytest.mark.parametrize("k", [1, 4])
def test_oracle_drafter_replays_given_tokens_and_accepts_them_all(models, k):
    """Method "oracle" drafts the given sequences (plain greedy's, by the random model's main weights in a
    model with no MTP modules: the oracle needs none): every draft is accepted except where a row's cap
    cuts the block, and the tokens equal plain greedy."""
    model = make_model(CFG.replace(num_nextn_predict_layers=0), 0, 0.0)
    nnx.update(model, nnx.state(models["deepseek"]["random"], MAIN_PARAMS))
    expected = generate(model, PROMPTS, max_new_tokens=MAX_NEW, max_length=S, stop_tokens=[]).tokens
    reference = np.zeros((3, S), np.int32)
    for b, (p, t) in enumerate(zip(PROMPTS, expected, strict=True)):
        reference[b, : len(p) + len(t)] = p + t
    engine = DecodeEngine(model, spec("oracle", k))
    state, padded = engine.init_state(PROMPTS, max_new_tokens=MAX_NEW, max_length=S, stop_tokens=[],
                                      oracle_tokens=reference)
    result = engine.result(engine.run(engine.prefill(state, padded)), 0.0)
    assert result.tokens == expected
    steps = [-(-(n - 1) // (k + 1)) for n in MAX_NEW]  # after the prefill's token, K + 1 per step
    assert result.num_steps == max(steps) and result.metrics.num_steps == sum(steps)
    # Every committed token is an accepted draft but the bonus of each full block (a block cut short by
    # max_new_tokens commits drafts only).
    assert result.metrics.num_accepted == sum(n - 1 - (n - 1) // (k + 1) for n in MAX_NEW)


def test_oracle_tokens_are_checked(models):
    model = models["deepseek"]["random"]
    with pytest.raises(ValueError, match="oracle_tokens is required"):
        generate(model, PROMPTS, speculative=spec("oracle", 2), max_new_tokens=3, max_length=S)
    with pytest.raises(ValueError, match="oracle_tokens is required with method='oracle' and only there"):
        DecodeEngine(model, spec("eagle", 2)).init_state(PROMPTS, max_new_tokens=3, max_length=S,
                                                         oracle_tokens=np.zeros((3, S), np.int32))
    with pytest.raises(ValueError, match=r"oracle_tokens must be an int array \[B=3, R\]"):
        DecodeEngine(model, spec("oracle", 2)).init_state(PROMPTS, max_new_tokens=3, max_length=S,
                                                          oracle_tokens=np.zeros((2, S), np.int32))
    with pytest.raises(ValueError, match="draft_sampling must be 'greedy'"):
        SpeculativeConfig(method="oracle", draft_sampling="sample")


@pytest.mark.parametrize("relaxed", [False, True])
def test_a_step_normalises_the_verify_logits_once(models, monkeypatch, relaxed):
    """One log-softmax (raw logprobs, relaxed acceptance) and one `target_probs` (acceptance, sampling)
    over the verify logits per step, whatever is on: counted while tracing the step."""
    import mtp_jax.decode.acceptance as acceptance
    from mtp_jax.decode.engine import step

    calls = {"log_softmax": 0, "target_probs": 0}

    def counted(name, fn):
        def wrapper(*args, **kwargs):
            calls[name] += 1
            return fn(*args, **kwargs)
        return wrapper

    monkeypatch.setattr(acceptance.jax.nn, "log_softmax", counted("log_softmax", jax.nn.log_softmax))
    monkeypatch.setattr(acceptance, "target_probs", counted("target_probs", acceptance.target_probs))
    sp = spec("eagle", 2, relaxed_top_n=2, relaxed_delta=0.1) if relaxed else spec("eagle", 2)
    model = models["deepseek"]["random"]
    state, _ = DecodeEngine(model, sp).init_state(PROMPTS, max_new_tokens=3, max_length=S)
    jax.make_jaxpr(lambda s: step(model, sp, s))(state)
    assert calls == {"log_softmax": 1, "target_probs": 1}
