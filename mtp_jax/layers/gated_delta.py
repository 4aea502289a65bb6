"""Gated DeltaNet: the linear attention with a recurrent state of Qwen3.5's linear-attention layers.

Gated DeltaNet (Yang, Kautz and Hatamizadeh 2024, "Gated Delta Networks: Improving Mamba2 with Delta Rule",
arXiv 2412.06464) keeps, per value head, a state S [Dk, Dv] mapping keys to values. Token t decays the state by
exp(g_t) (g_t <= 0, a log decay), moves the state's read of the key k_t towards the value v_t by a step
beta_t in [0, 1] (the delta rule), and reads the query q_t:

    S <- exp(g_t) S;    S <- S + k_t ⊗ beta_t (v_t - k_t^T S);    o_t = q_t^T S

with q and k l2-normalised and q scaled by Dk**-0.5. Value heads share key heads in groups (Hv a multiple of
Hk; value head h reads key head h // (Hv // Hk)). Before it, a causal depthwise convolution of width W with a
SiLU mixes each q, k and v channel with its last W-1 inputs; its state is the window of those inputs.

This follows `transformers.models.qwen3_5.modeling_qwen3_5` (transformers 5.x): `l2norm` its `l2norm`;
`causal_conv` its `causal_conv1d_fn` / `causal_conv1d_update` with activation "silu" and no bias;
`gated_delta_recurrent` its `torch_recurrent_gated_delta_rule` (one `lax.scan` step per token: decode,
verify) and `gated_delta_chunked` its `torch_chunk_gated_delta_rule` (the WY / UT-transform form: matmuls
within chunks, one scan step per chunk: prefill), both with `use_qk_l2norm_in_kernel=True`. The math is
float32 whatever the input dtype; the two forms agree to float32 rounding.

Masking: a token with g = 0 and beta = 0 leaves the state exactly as it was, in both forms (a decay of
exp(0) = 1 and a zero step). Callers running rows of different lengths in one [B, T] batch (right padding, or
a speculative verify pass whose rows accept different numbers of tokens) freeze each row's state after its
last real token with `freeze_after(g, beta, advance)`, and take the conv window after it with `causal_conv`'s
`advance` (or `mtp_jax.cache.window_after`). Outputs at frozen positions are finite but meaningless.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.scipy.linalg import solve_triangular
from jaxtyping import Array, Float, Int

from mtp_jax.cache import window_after

# float32 contractions in full float32 (no TF32 on GPUs): the state carries rounding across the whole sequence.
_einsum = functools.partial(jnp.einsum, precision=lax.Precision.HIGHEST)


def l2norm(x: Float[Array, "... D"], eps: float = 1e-6) -> Float[Array, "... D"]:
    """x / sqrt(sum(x^2) + eps) over the last axis, float32 (transformers' `l2norm`, FLA's eps placement)."""
    x = x.astype(jnp.float32)
    return x * lax.rsqrt(jnp.sum(x * x, axis=-1, keepdims=True) + eps)


def causal_conv(
    window: Float[Array, "B Wm1 C"],
    x: Float[Array, "B T C"],
    weight: Float[Array, "C 1 W"],
    advance: Int[Array, " B"] | None = None,
    segment_ids: Int[Array, "B T"] | None = None,
) -> tuple[Float[Array, "B T C"], Float[Array, "B Wm1 C"]]:
    """The causal depthwise convolution with SiLU of `causal_conv1d_fn(..., activation="silu")` (no bias),
    continued from `window`, and the window after it.

    segment_ids: optional int32 [B, T], packed documents (training, from an empty window): token t's output
    reads only the inputs of its own segment, as if each document were convolved alone.

    window: the W-1 inputs before x (zeros at the start of a sequence); weight: the checkpoint's `conv1d.weight`
    layout. With full = concat(window, x) over time, out[b, t, c] = silu(sum_j weight[c, 0, j] full[b, t + j, c]),
    computed in float32 and returned in x.dtype. The new window is full[b, advance[b] : advance[b] + W - 1], the
    last W-1 inputs up to new token advance[b] - 1 (advance in [0, T], default T: all of x; 0 keeps `window`);
    tokens from advance[b] on are padding whose outputs are don't-care. The window is returned in x.dtype.
    """
    width, steps = weight.shape[-1], x.shape[1]
    full = jnp.concatenate([window.astype(x.dtype), x], axis=1)
    full32, taps = full.astype(jnp.float32), weight[:, 0, :].astype(jnp.float32)
    if segment_ids is None:
        acc = sum(taps[:, j] * full32[:, j : j + steps] for j in range(width))
    else:  # tap j reads token t + j - (W - 1): only within t's segment (the window counts as token 0's)
        ids = jnp.concatenate([jnp.repeat(segment_ids[:, :1], width - 1, axis=1), segment_ids], axis=1)
        own = [(ids[:, j : j + steps] == segment_ids)[..., None] for j in range(width)]  # [B, T, 1] each
        acc = sum(jnp.where(own[j], taps[:, j] * full32[:, j : j + steps], 0.0) for j in range(width))
    new_window = full[:, steps:] if advance is None else window_after(full, advance, width - 1)
    return jax.nn.silu(acc).astype(x.dtype), new_window


def freeze_after(
    g: Float[Array, "B T H"], beta: Float[Array, "B T H"], advance: Int[Array, " B"]
) -> tuple[Float[Array, "B T H"], Float[Array, "B T H"]]:
    """g and beta with the tokens t >= advance[b] of each row set to 0, so that both forms leave row b's state
    as it was after its first advance[b] tokens (the masking convention: module docstring)."""
    live = (jnp.arange(g.shape[1]) < advance[:, None])[..., None]
    return jnp.where(live, g, 0), jnp.where(live, beta, 0)


def _prepare(q, k, v, g, beta):
    """float32 operands, q and k l2-normalised (q scaled by Dk**-0.5) and repeated to the value heads."""
    groups = v.shape[2] // k.shape[2]
    q = l2norm(q) * q.shape[-1] ** -0.5
    q, k = jnp.repeat(q, groups, axis=2), jnp.repeat(l2norm(k), groups, axis=2)
    return q, k, v.astype(jnp.float32), g.astype(jnp.float32), beta.astype(jnp.float32)


def _segment_starts(segment_ids: Int[Array, "B T"]) -> jax.Array:
    """bool [B, T]: token t starts a new segment (its id differs from token t - 1's; never token 0)."""
    return jnp.pad(segment_ids[:, 1:] != segment_ids[:, :-1], ((0, 0), (1, 0)))


def gated_delta_recurrent(
    q: Float[Array, "B T Hk Dk"],
    k: Float[Array, "B T Hk Dk"],
    v: Float[Array, "B T Hv Dv"],
    g: Float[Array, "B T Hv"],
    beta: Float[Array, "B T Hv"],
    state: Float[Array, "B Hv Dk Dv"],
    *,
    keep_states: bool = False,
    segment_ids: Int[Array, "B T"] | None = None,
) -> tuple[Float[Array, "B T Hv Dv"], Float[Array, "B Hv Dk Dv"] | Float[Array, "B T+1 Hv Dk Dv"]]:
    """The gated delta rule token by token (`torch_recurrent_gated_delta_rule`, `use_qk_l2norm_in_kernel=True`).

    g: log decays (<= 0); beta: steps; state: float32, the state before the first token. Returns the outputs
    in v.dtype (math in float32) and the final float32 state, or with `keep_states` every state [B, T+1, Hv, Dk,
    Dv]: index i is the state after the first i tokens (index 0 is `state`), for a speculative commit of i tokens.
    segment_ids: optional int32 [B, T], packed documents: the state restarts from zero where the id changes.
    """
    dtype = v.dtype
    q, k, v, g, beta = _prepare(q, k, v, g, beta)
    starts = jnp.zeros(g.shape[:2], bool) if segment_ids is None else _segment_starts(segment_ids)  # [B, T]

    def step(s, xs):  # s [B, H, Dk, Dv]; one token per row: q_t, k_t [B, H, Dk], v_t [B, H, Dv], g_t, b_t [B, H]
        q_t, k_t, v_t, g_t, b_t, start = xs
        s = jnp.where(start[:, None, None, None], 0.0, s) * jnp.exp(g_t)[..., None, None]
        delta = (v_t - _einsum("bhk,bhkv->bhv", k_t, s)) * b_t[..., None]
        s = s + k_t[..., :, None] * delta[..., None, :]
        return s, (_einsum("bhk,bhkv->bhv", q_t, s), s if keep_states else None)

    state = state.astype(jnp.float32)
    final, (out, states) = lax.scan(step, state, tuple(jnp.moveaxis(x, 1, 0) for x in (q, k, v, g, beta, starts)))
    out = jnp.moveaxis(out, 0, 1).astype(dtype)
    if keep_states:
        return out, jnp.concatenate([state[:, None], jnp.moveaxis(states, 0, 1)], axis=1)
    return out, final


def gated_delta_chunked(
    q: Float[Array, "B T Hk Dk"],
    k: Float[Array, "B T Hk Dk"],
    v: Float[Array, "B T Hv Dv"],
    g: Float[Array, "B T Hv"],
    beta: Float[Array, "B T Hv"],
    state: Float[Array, "B Hv Dk Dv"],
    *,
    chunk_size: int = 64,
    segment_ids: Int[Array, "B T"] | None = None,
) -> tuple[Float[Array, "B T Hv Dv"], Float[Array, "B Hv Dk Dv"]]:
    """`gated_delta_recurrent`'s outputs and final state by chunks (`torch_chunk_gated_delta_rule`).

    T is padded to a multiple of `chunk_size` with k = v = g = beta = 0 tokens, which leave the state as it was.
    Within a chunk, with c the cumulative log decay from the chunk's start and A[i, j] = beta_i k_i.k_j
    exp(c_i - c_j) for j < i, the UT transform (I + A)^-1 (a unit-lower-triangular solve) turns the chunk's
    delta-rule updates into u = (I + A)^-1 (beta v), the values to write before the old state's correction, and
    w = (I + A)^-1 (beta exp(c) k), the keys reading the old state. A scan over chunks then carries the state:
    v_new = u - w S; o = (exp(c) q) S + causal(q k^T exp(c_i - c_j)) v_new; S <- exp(c_last) S + (exp(c_last - c)
    k)^T v_new. Outputs in v.dtype, the final state float32.

    segment_ids: optional int32 [B, T], packed documents: the state restarts from zero where the id changes, as
    the recurrent form's. Every exp(c_i - c_j) between tokens of different segments is zeroed, and so is the old
    state's reach (exp(c) q, exp(c) k, exp(c_last)) into a chunk's tokens past a segment start; no -inf enters
    the cumulative sums.
    """
    batch, steps, heads, dv = v.shape
    dtype = v.dtype
    q, k, v, g, beta = _prepare(q, k, v, g, beta)
    pad = -steps % chunk_size
    n = (steps + pad) // chunk_size

    def chunks(x):  # [B, T, H, ...] -> [N, B, H, C, ...]: chunk index first, for the scan
        x = jnp.pad(x, [(0, 0), (0, pad)] + [(0, 0)] * (x.ndim - 2))
        return jnp.moveaxis(x.reshape(batch, n, chunk_size, *x.shape[2:]), (1, 3), (0, 2))

    q, k, v, g, beta = (chunks(x) for x in (q, k, v, g, beta))
    cum = jnp.cumsum(g, axis=-1)  # [N, B, H, C]
    causal = jnp.tril(jnp.ones((chunk_size, chunk_size), bool))
    # exp(c_i - c_j) on and below the diagonal, 0 above (masked before the exp: no overflow)
    decay = jnp.exp(jnp.where(causal, cum[..., :, None] - cum[..., None, :], -jnp.inf))
    from_start = jnp.exp(cum)  # [N, B, H, C]: the old state's decay to token i
    to_end = jnp.exp(cum[..., -1:] - cum)  # token j's decay to the chunk's end
    if segment_ids is not None:
        ids = jnp.pad(segment_ids, ((0, 0), (0, pad)), mode="edge").reshape(batch, n, chunk_size)
        ids = jnp.moveaxis(ids, 1, 0)[:, :, None, :]  # [N, B, 1, C]
        before = jnp.concatenate([ids[:1, ..., :1], ids[:-1, ..., -1:]], axis=0)  # the token before each chunk
        decay = decay * (ids[..., :, None] == ids[..., None, :])
        from_start = from_start * (ids == before)
        to_end = to_end * (ids == ids[..., -1:])
    k_beta = k * beta[..., None]
    system = _einsum("...ik,...jk->...ij", k_beta, k) * decay  # its diagonal is ignored: unit_diagonal
    attn = _einsum("...ik,...jk->...ij", q, k) * decay
    rhs = jnp.concatenate([v * beta[..., None], k_beta * from_start[..., None]], axis=-1)
    solved = solve_triangular(system, rhs, lower=True, unit_diagonal=True)
    u, w = solved[..., :dv], solved[..., dv:]
    q_decayed = q * from_start[..., None]
    k_decayed = k * to_end[..., None]
    chunk_decay = from_start[..., -1][..., None, None]  # [N, B, H, 1, 1]

    def step(s, xs):  # s [B, H, Dk, Dv]; one chunk of every row
        u_c, w_c, q_c, k_c, attn_c, decay_c = xs
        v_new = u_c - _einsum("bhck,bhkv->bhcv", w_c, s)
        out = _einsum("bhck,bhkv->bhcv", q_c, s) + _einsum("bhij,bhjv->bhiv", attn_c, v_new)
        return s * decay_c + _einsum("bhck,bhcv->bhkv", k_c, v_new), out

    final, out = lax.scan(step, state.astype(jnp.float32), (u, w, q_decayed, k_decayed, attn, chunk_decay))
    out = jnp.moveaxis(out, (1, 3), (0, 2)).reshape(batch, n * chunk_size, heads, dv)
    return out[:, :steps].astype(dtype), final
