"""Qwen3.5's Gated DeltaNet layer (`linear_attn`): linear attention with a recurrent state, against a
`RecurrentCache` under the model contract.

Hugging Face's `Qwen3_5GatedDeltaNet` (transformers 5.24), with its names: `in_proj_qkv` [E, 2 Hk Dk + Hv Dv]
(queries, keys, values), `in_proj_z` [E, Hv Dv] (the output gate), `in_proj_b`, `in_proj_a` [E, Hv] (the
write strength beta = sigmoid(b) and the decay g = -exp(A_log) softplus(a + dt_bias)), `conv1d.weight`
[C, 1, W] (a causal depthwise conv over the C = 2 Hk Dk + Hv Dv channels of `in_proj_qkv`, then SiLU),
`norm` (`GatedRMSNorm` over each value head, gated by SiLU(z)) and `out_proj` [Hv Dv, E]. The recurrence is
`mtp_jax.layers.gated_delta`'s (arXiv 2412.06464): the recurrent form for decode and verify (T <=
`RECURRENT_MAX_TOKENS`), the chunked form for longer calls (prefills), equal to float32 rounding.

The layer's cache is the state after the row's earlier positions; a call advances it through the new
tokens (the first `advance[b]` of them: padding after a prompt leaves it unchanged) or, with
`keep_candidates` (a verify pass), returns the state after each new token for the commit to choose from
(`mtp_jax.cache.RecurrentCandidates`, `settle`). Positions play no part: a row's tokens must arrive in order.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx
from jaxtyping import Array, Float, Int

from mtp_jax.cache import RecurrentCache, RecurrentCandidates
from mtp_jax.config import ModelConfig
from mtp_jax.layers.gated_delta import causal_conv, freeze_after, gated_delta_chunked, gated_delta_recurrent
from mtp_jax.layers.linear import linear
from mtp_jax.layers.norm import GatedRMSNorm

# Calls of at most this many new tokens per row (decode and verify steps) run the recurrent form, a scan over
# the tokens; longer ones (prefills) the chunked form, whose sequential part is one step per 64 tokens.
RECURRENT_MAX_TOKENS = 32


class ShortConv(nnx.Module):
    """HF's depthwise `nn.Conv1d(C, C, W, groups=C, bias=False)`: `weight` [C, 1, W] as the checkpoint stores it."""

    def __init__(self, channels: int, width: int, config: ModelConfig, rngs: nnx.Rngs):
        init = nnx.initializers.normal(config.initializer_range)
        self.weight = nnx.Param(init(rngs.params(), (channels, 1, width), config.weight_dtype))


class GatedDeltaNet(nnx.Module):
    """One Gated DeltaNet token mixer: [B, T, E] -> [B, T, E] and its `RecurrentCache` advanced (module docstring)."""

    def __init__(self, config: ModelConfig, rngs: nnx.Rngs):
        c = self.config = config
        hv, dk, dv = c.linear_num_value_heads, c.linear_key_head_dim, c.linear_value_head_dim
        key_dim, value_dim = c.linear_num_key_heads * dk, hv * dv
        e = c.hidden_size

        def proj(fan_in: int, fan_out: int, name: str, axes) -> nnx.Module:
            return linear(c, fan_in, fan_out, rngs, axes=axes, name=f"linear_attn.{name}")

        # Tensor parallelism splits the value heads ("heads"): z, a, b, the decay parameters, the state and
        # out_proj's rows. in_proj_qkv (queries and keys of the key heads, then the values: no contiguous
        # shard is whole heads) and the conv over its channels stay whole on every device.
        self.in_proj_qkv = proj(e, 2 * key_dim + value_dim, "in_proj_qkv", ("embed", None))
        self.in_proj_z = proj(e, value_dim, "in_proj_z", ("embed", ("heads", dv)))
        self.in_proj_b = proj(e, hv, "in_proj_b", ("embed", "heads"))
        self.in_proj_a = proj(e, hv, "in_proj_a", ("embed", "heads"))
        self.conv1d = ShortConv(2 * key_dim + value_dim, c.linear_conv_kernel_dim, c, rngs)
        self.dt_bias = nnx.Param(jnp.ones((hv,), jnp.float32), logical_axes=("heads",))
        # HF draws A from U(0.01, 16); float32, as the router's weights (HF computes the decay in float32).
        a_init = jax.random.uniform(rngs.params(), (hv,), jnp.float32, 0.01, 16.0)
        self.A_log = nnx.Param(jnp.log(a_init), logical_axes=("heads",))
        self.norm = GatedRMSNorm(dv, c.rms_norm_eps, c.weight_dtype)
        self.out_proj = proj(value_dim, e, "out_proj", (("heads", dv), "embed"))

    def __call__(
        self,
        x: Float[Array, "B T E"],
        cache: RecurrentCache,
        *,
        advance: Int[Array, " B"] | None = None,
        keep_candidates: bool = False,
        segment_ids: Int[Array, "B T"] | None = None,
    ) -> tuple[Float[Array, "B T E"], RecurrentCache | RecurrentCandidates]:
        """The mixer's output for T new tokens per row, after the positions `cache` summarises.

        Args:
          x: the normed hidden states [B, T, E].
          cache: the row's state so far.
          advance: optional int32 [B] in [0, T]: the state absorbs row b's first `advance[b]` tokens only (the
            rest is padding; their outputs are finite and meaningless). Default: all T.
          keep_candidates: static; return `RecurrentCandidates` (the state after each new token, for a
            speculative commit to select) instead of the advanced `RecurrentCache`.
          segment_ids: optional int32 [B, T], packed documents (training, from an empty cache): the state and
            the conv restart at each segment's first token, as if each document ran alone.

        Returns:
          The output [B, T, E] in x's dtype, and the new cache (or candidates).
        """
        c = self.config
        batch, num, _ = x.shape
        hk, hv = c.linear_num_key_heads, c.linear_num_value_heads
        dk, dv = c.linear_key_head_dim, c.linear_value_head_dim
        mixed = self.in_proj_qkv(x)  # [B, T, C]
        z = self.in_proj_z(x).reshape(batch, num, hv, dv)
        beta = jax.nn.sigmoid(self.in_proj_b(x).astype(jnp.float32))  # [B, T, Hv]
        a = self.in_proj_a(x).astype(jnp.float32)
        g = -jnp.exp(self.A_log[...]) * jax.nn.softplus(a + self.dt_bias[...])  # [B, T, Hv], log decay <= 0
        conv_in = mixed.astype(cache.conv.dtype)
        mixed, window = causal_conv(cache.conv, conv_in, self.conv1d.weight[...], advance, segment_ids)  # [B, T, C]
        q, k, v = jnp.split(mixed, [hk * dk, 2 * hk * dk], axis=-1)
        q, k = q.reshape(batch, num, hk, dk), k.reshape(batch, num, hk, dk)
        v = v.reshape(batch, num, hv, dv)
        if advance is not None:
            g, beta = freeze_after(g, beta, advance)
        if keep_candidates:
            core, states = gated_delta_recurrent(q, k, v, g, beta, cache.state, keep_states=True)
            new_cache = RecurrentCandidates(states=states, conv=jnp.concatenate([cache.conv, conv_in], axis=1))
        else:
            form = gated_delta_recurrent if num <= RECURRENT_MAX_TOKENS else gated_delta_chunked
            core, state = form(q, k, v, g, beta, cache.state, segment_ids=segment_ids)
            new_cache = RecurrentCache(state=state, conv=window)
        out = self.norm(core.astype(x.dtype), z).reshape(batch, num, hv * dv)  # [B, T, Hv Dv]
        return self.out_proj(out), new_cache
