"""`mtp_jax.layers.gated_delta` (Qwen3.5's Gated DeltaNet) against transformers' PyTorch reference functions
(`transformers.models.qwen3_5.modeling_qwen3_5`), on CPU in float32, and the masking convention of its callers:
g = beta = 0 tokens freeze the state, `causal_conv`'s `advance` picks the conv window after a row's real tokens.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from mtp_jax.cache import window_after
from mtp_jax.layers import gated_delta
from mtp_jax.layers.gated_delta import freeze_after, l2norm

torch = pytest.importorskip("torch", reason="the transformers oracle needs the [parity] extra")
pytest.importorskip("transformers", reason="the transformers oracle needs the [parity] extra")
from transformers.models.qwen3_5 import modeling_qwen3_5 as hf  # noqa: E402

torch.set_num_threads(1)

# Jitted: one compilation per shape instead of one per primitive (the file's runtime)
gated_delta_recurrent = jax.jit(gated_delta.gated_delta_recurrent, static_argnames="keep_states")
gated_delta_chunked = jax.jit(gated_delta.gated_delta_chunked, static_argnames="chunk_size")
causal_conv = jax.jit(gated_delta.causal_conv)

HK, HV, DK, DV, W, C = 2, 4, 8, 6, 4, 12
RTOL = 1e-5  # max |ours - theirs| / max |theirs|


def assert_close(ours, theirs, rtol=RTOL):
    ours, theirs = np.asarray(ours, np.float32), np.asarray(theirs, np.float32)
    assert ours.shape == theirs.shape, (ours.shape, theirs.shape)
    assert np.isfinite(ours).all()
    err = np.abs(ours - theirs).max() / max(np.abs(theirs).max(), 1e-30)
    assert err <= rtol, f"relative error {err:.3g} > {rtol:.3g}"


def inputs(steps: int, batch: int = 2, seed: int = 0):
    """q, k [B, T, HK, DK], v [B, T, HV, DV], g (log decays in [-1, -0.01]), beta in (0, 1), a nonzero state."""
    rng = np.random.default_rng(seed)
    q = rng.normal(size=(batch, steps, HK, DK)).astype(np.float32)
    k = rng.normal(size=(batch, steps, HK, DK)).astype(np.float32)
    v = rng.normal(size=(batch, steps, HV, DV)).astype(np.float32)
    g = -rng.uniform(0.01, 1.0, size=(batch, steps, HV)).astype(np.float32)
    beta = rng.uniform(0.0, 1.0, size=(batch, steps, HV)).astype(np.float32)
    state = (0.5 * rng.normal(size=(batch, HV, DK, DV))).astype(np.float32)
    return q, k, v, g, beta, state


def torch_rule(fn, q, k, v, g, beta, state, **kwargs):
    q, k, v, g, beta, state = (torch.from_numpy(x) for x in (q, k, v, g, beta, state))
    out, final = fn(
        q, k, v, g=g, beta=beta, initial_state=state, output_final_state=True, use_qk_l2norm_in_kernel=True, **kwargs
    )
    return out.numpy(), final.numpy()


def test_l2norm_matches_transformers():
    x = np.random.default_rng(1).normal(size=(3, 5, DK)).astype(np.float32)
    x[0, 0] = 0.0  # eps keeps a zero vector finite
    assert_close(l2norm(jnp.asarray(x)), hf.l2norm(torch.from_numpy(x)).numpy())


@pytest.mark.parametrize("steps", [1, 5, 70])
def test_recurrent_matches_transformers(steps):
    args = inputs(steps)
    out, final = gated_delta_recurrent(*map(jnp.asarray, args))
    ref_out, ref_final = torch_rule(hf.torch_recurrent_gated_delta_rule, *args)
    assert out.dtype == jnp.float32 and final.dtype == jnp.float32
    assert_close(out, ref_out)
    assert_close(final, ref_final)


@pytest.mark.parametrize(("steps", "chunk_size"), [(1, 16), (5, 16), (70, 16), (130, 64)])
def test_chunked_matches_transformers_and_recurrent(steps, chunk_size):
    args = inputs(steps, seed=steps)
    out, final = gated_delta_chunked(*map(jnp.asarray, args), chunk_size=chunk_size)
    ref_out, ref_final = torch_rule(hf.torch_chunk_gated_delta_rule, *args, chunk_size=chunk_size)
    assert_close(out, ref_out)
    assert_close(final, ref_final)
    rec_out, rec_final = gated_delta_recurrent(*map(jnp.asarray, args))
    assert_close(out, rec_out)
    assert_close(final, rec_final)


def test_keep_states_are_the_states_after_each_prefix():
    steps = 5
    args = inputs(steps, seed=3)
    out, states = gated_delta_recurrent(*map(jnp.asarray, args), keep_states=True)
    ref_out, final = gated_delta_recurrent(*map(jnp.asarray, args))
    assert states.shape == (2, steps + 1, HV, DK, DV)
    np.testing.assert_array_equal(out, ref_out)
    np.testing.assert_array_equal(states[:, -1], final)
    np.testing.assert_array_equal(states[:, 0], args[-1])
    for i in range(1, steps):  # the prefixes' final states, from the oracle (no compilation per prefix)
        _, prefix = torch_rule(hf.torch_recurrent_gated_delta_rule, *(x[:, :i] for x in args[:-1]), args[-1])
        assert_close(states[:, i], prefix)


@pytest.mark.parametrize("chunked", [False, True])
def test_freeze_after_keeps_the_state_of_each_rows_prefix(chunked):
    steps = 37
    advance = np.array([0, 20, steps], np.int32)  # a row with no real token, one in the middle, a full one
    q, k, v, g, beta, state = args = inputs(steps, batch=3, seed=4)
    g_frozen, beta_frozen = freeze_after(jnp.asarray(g), jnp.asarray(beta), jnp.asarray(advance))
    live = np.arange(steps)[None, :, None] < advance[:, None, None]
    np.testing.assert_array_equal(g_frozen, np.where(live, g, 0))
    np.testing.assert_array_equal(beta_frozen, np.where(live, beta, 0))

    if chunked:
        form, ref_form, kwargs = gated_delta_chunked, hf.torch_chunk_gated_delta_rule, {"chunk_size": 16}
    else:
        form, ref_form, kwargs = gated_delta_recurrent, hf.torch_recurrent_gated_delta_rule, {}
    out, final = form(*map(jnp.asarray, (q, k, v)), g_frozen, beta_frozen, jnp.asarray(state), **kwargs)
    unmasked, _ = form(*map(jnp.asarray, args), **kwargs)
    assert np.isfinite(np.asarray(out)).all()
    for b, n in enumerate(advance):
        if n == 0:
            np.testing.assert_array_equal(final[b], state[b])
            continue
        # the state of running only the row's first n tokens (the oracle: no compilation per prefix)
        ref_out, ref_final = torch_rule(ref_form, *(x[b : b + 1, :n] for x in args[:-1]), state[b : b + 1], **kwargs)
        assert_close(final[b : b + 1], ref_final)
        assert_close(out[b : b + 1, :n], ref_out)
        assert_close(out[b, :n], unmasked[b, :n])  # outputs before advance are unchanged by the masking


def conv_inputs(steps: int, batch: int = 2, seed: int = 5):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(batch, steps, C)).astype(np.float32)
    weight = (0.5 * rng.normal(size=(C, 1, W))).astype(np.float32)  # the checkpoint's conv1d.weight layout
    return x, weight


@pytest.mark.parametrize("steps", [2, 70])
def test_causal_conv_matches_transformers(steps):
    x, weight = conv_inputs(steps)
    window = jnp.zeros((2, W - 1, C), jnp.float32)
    out, new_window = causal_conv(window, jnp.asarray(x), jnp.asarray(weight))
    xt = torch.from_numpy(x).transpose(1, 2)
    ref = hf.causal_conv1d_fn(xt, torch.from_numpy(weight).squeeze(1), None, activation="silu").transpose(1, 2)
    assert_close(out, ref.numpy())
    full = np.concatenate([np.zeros((2, W - 1, C), np.float32), x], axis=1)
    np.testing.assert_array_equal(new_window, full[:, -(W - 1) :])


def test_causal_conv_continues_from_its_window():
    x, weight = conv_inputs(12)
    x, weight = jnp.asarray(x), jnp.asarray(weight)
    zeros = jnp.zeros((2, W - 1, C), jnp.float32)
    out, window = causal_conv(zeros, x, weight)
    head, mid = causal_conv(zeros, x[:, :5], weight)
    tail, end = causal_conv(mid, x[:, 5:], weight)
    assert_close(jnp.concatenate([head, tail], axis=1), out)
    np.testing.assert_array_equal(end, window)


def test_causal_conv_advance_and_window_after():
    steps = 6
    x, weight = conv_inputs(steps, batch=4)
    window = np.random.default_rng(6).normal(size=(4, W - 1, C)).astype(np.float32)
    full = np.concatenate([window, x], axis=1)
    advance = np.array([0, 1, 4, steps], np.int32)
    out, new_window = causal_conv(*map(jnp.asarray, (window, x, weight, advance)))
    ref_out, _ = causal_conv(*map(jnp.asarray, (window, x, weight)))
    np.testing.assert_array_equal(out, ref_out)  # advance changes only the window
    np.testing.assert_array_equal(new_window[0], window[0])  # advance 0 keeps the old window
    for b, n in enumerate(advance):
        np.testing.assert_array_equal(new_window[b], full[b, n : n + W - 1])
    n = np.array([2, 0, steps, 3], np.int32)
    picked = window_after(jnp.asarray(full), jnp.asarray(n), W - 1)
    np.testing.assert_array_equal(picked, np.stack([full[b, i : i + W - 1] for b, i in enumerate(n)]))


def test_packed_segments_run_as_separate_documents():
    """Packed training rows (`segment_ids`): both forms and the conv give each document's outputs exactly as
    running it alone from a zero state and a zero window would (the transformers reference, per document).
    Row 0 packs documents of 5, 20 and 45 tokens (boundaries inside and across 16-token chunks), row 1 is one
    document; the final state is the last document's."""
    lengths, steps = [5, 20, 45], 70
    q, k, v, g, beta, _ = inputs(steps, seed=11)
    zero = np.zeros((2, HV, DK, DV), np.float32)
    segment_ids = np.stack([np.repeat([1, 2, 3], lengths), np.ones(steps, int)]).astype(np.int32)
    want_out = np.zeros_like(v)
    want_final = np.zeros_like(zero)
    for b, bounds in enumerate([np.cumsum([0, *lengths]), [0, steps]]):
        for start, stop in zip(bounds[:-1], bounds[1:], strict=True):
            piece = (x[b : b + 1, start:stop] for x in (q, k, v, g, beta))
            out, final = torch_rule(hf.torch_recurrent_gated_delta_rule, *piece, zero[:1])
            want_out[b, start:stop], want_final[b] = out[0], final[0]
    args = (*map(jnp.asarray, (q, k, v, g, beta, zero)),)
    ids = jnp.asarray(segment_ids)
    for out, final in (
        gated_delta_recurrent(*args, segment_ids=ids),
        gated_delta_chunked(*args, chunk_size=16, segment_ids=ids),
    ):
        assert_close(out, want_out)
        assert_close(final, want_final)

    x = np.random.default_rng(12).normal(size=(2, steps, C)).astype(np.float32)
    weight = np.random.default_rng(13).normal(size=(C, 1, W)).astype(np.float32)
    out, _ = causal_conv(jnp.zeros((2, W - 1, C)), jnp.asarray(x), jnp.asarray(weight), None, ids)
    for b, bounds in enumerate([np.cumsum([0, *lengths]), [0, steps]]):
        for start, stop in zip(bounds[:-1], bounds[1:], strict=True):
            ref = hf.causal_conv1d_fn(
                torch.from_numpy(x[b : b + 1, start:stop]).transpose(1, 2),
                torch.from_numpy(weight[:, 0]),
                activation="silu",
            )
            assert_close(out[b, start:stop], ref.transpose(1, 2)[0].numpy())
