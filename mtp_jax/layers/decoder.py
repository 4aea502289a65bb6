"""The pre-norm decoder layer (Llama / DeepSeek-V3 names), shared by the main model and the MTP modules.

Its token mixer is the config's attention (`attention_type`: grouped-query `Attention` with a `KVCache`, or
DeepSeek-V3's `MLAttention` with an `MLACache`), or, in a hybrid model's "linear_attention" layers
(`ModelConfig.layer_types`, Qwen3.5), a `GatedDeltaNet` with a `RecurrentCache`; its feed-forward block is
the layer's (`MLP`, or the `MoE` from layer `first_k_dense_replace` on; DeepSeek-V3's MTP layers, numbered
after the main model's, are MoE layers too).

`DecoderStack` holds consecutive layers of one kind as one module whose every parameter has a leading
layer axis, and runs them under `jax.lax.scan` (`ModelConfig.scan_layers`): the compiled program holds
one layer body per stack instead of one per layer.
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import PartitionSpec as P
from jaxtyping import Array, Float, Int

from mtp_jax.cache import KVCache, RecurrentCache, RecurrentCandidates, StackedCache, check_shape
from mtp_jax.config import ModelConfig
from mtp_jax.layers.attention import Attention
from mtp_jax.layers.ffn import MLP
from mtp_jax.layers.gated_deltanet import GatedDeltaNet
from mtp_jax.layers.mla import MLACache, MLAttention
from mtp_jax.layers.moe import MoE, RoutingStats
from mtp_jax.layers.norm import RMSNorm
from mtp_jax.sharding import constrain

ACTIVATIONS = P("batch", None, None)  # logical axes of the hidden states [B, T, E] between blocks

# MLA runs in its absorbed form (attention in the latent space over the compressed cache) for at most
# this many new tokens per row: decode and verify steps. Longer calls (prefills) decompress the cache
# into per-head keys and values, which costs fewer FLOPs per query there.
MLA_ABSORBED_MAX_TOKENS = 32


class DecoderLayer(nnx.Module):
    """Pre-norm transformer block: x + attn(norm(x)), then + mlp(norm(.))."""

    def __init__(self, config: ModelConfig, rngs: nnx.Rngs, layer_index: int = 0):
        self.config = config
        self.recurrent = config.layer_type(layer_index) == "linear_attention"
        self.input_layernorm = RMSNorm.of(config)
        if self.recurrent:
            self.linear_attn = GatedDeltaNet(config, rngs)
        else:
            self.self_attn = MLAttention(config, rngs) if config.attention_type == "mla" else Attention(config, rngs)
        self.post_attention_layernorm = RMSNorm.of(config)
        self.mlp = MoE(config, rngs) if config.is_moe_layer(layer_index) else MLP(config, rngs)

    def init_cache(self, batch_size: int, max_length: int) -> KVCache | MLACache | RecurrentCache:
        """This layer's empty cache (its token mixer's layout), capacity `max_length` tokens (a recurrent
        state has no capacity: `max_length` is only checked)."""
        if self.recurrent:
            check_shape(batch_size, max_length)
            return RecurrentCache.init(self.config, batch_size)
        cache_type = MLACache if self.config.attention_type == "mla" else KVCache
        return cache_type.init(self.config, batch_size, max_length)

    def __call__(
        self,
        x: Float[Array, "B T E"],
        positions: Int[Array, "B T"],
        cache: KVCache | MLACache | RecurrentCache,
        segment_ids: Int[Array, "B T"] | None = None,
        *,
        advance: Int[Array, " B"] | None = None,
        keep_candidates: bool = False,
    ) -> tuple[jax.Array, KVCache | MLACache | RecurrentCache | RecurrentCandidates]:
        """x + mixer(norm(x)), then + ffn(norm(.)), for T new tokens at `positions`; returns it and the cache.

        `advance` and `keep_candidates` reach a Gated DeltaNet only (`GatedDeltaNet.__call__`); attention
        ignores them (its entries past a row's length are stale anyway).

        With `segment_ids` (packed training rows, from an empty cache) tokens see only their own document, in
        attention (grouped-query or MLA, in whichever MLA form the row length selects) and in a Gated DeltaNet's
        state alike.
        """
        h = self.input_layernorm(x)
        if self.recurrent:
            attn, cache = self.linear_attn(
                h, cache, advance=advance, keep_candidates=keep_candidates, segment_ids=segment_ids
            )
        elif self.config.attention_type == "mla":
            absorbed = x.shape[1] <= MLA_ABSORBED_MAX_TOKENS
            attn, cache = self.self_attn(h, positions, cache, segment_ids, absorbed=absorbed)
        else:
            attn, cache = self.self_attn(h, positions, cache, segment_ids)
        x = x + attn
        # The block boundary: rows over the batch axes, the hidden axis whole on every device.
        return constrain(x + self.mlp(self.post_attention_layernorm(x)), ACTIVATIONS), cache


class DecoderStack(nnx.Module):
    """Layers `start .. start + num_layers - 1` of one kind, stacked, run in turn under `jax.lax.scan`.

    `layer` is a `DecoderLayer` whose every parameter carries a leading layer axis: `layer.<path>[i]`
    is layer `start + i`'s `<path>` (e.g. `layer.mlp.experts.gate_up_proj` [n, R, E, 2I]). Its cache is a
    `StackedCache` of that layer's cache type, every array [n, B, S, ...].
    """

    def __init__(self, layers: Sequence[DecoderLayer], start: int):
        """Stacks `layers` (consecutive, of one kind: equal graphs); raises ValueError if they differ."""
        graphdefs, states = zip(*(nnx.split(layer) for layer in layers), strict=True)
        if any(g != graphdefs[0] for g in graphdefs[1:]):
            raise ValueError(f"layers {start} .. {start + len(layers) - 1} are not all of one kind")
        self.start, self.num_layers = start, len(layers)
        stacked = jax.tree.map(lambda *xs: jnp.stack(xs), *states)
        for variable in jax.tree.leaves(stacked, is_leaf=lambda x: isinstance(x, nnx.Variable)):
            if "logical_axes" in variable.get_metadata():  # the new leading axis is the "layers" axis
                variable.set_metadata(logical_axes=("layers", *variable.get_metadata("logical_axes")))
        self.layer = nnx.merge(graphdefs[0], stacked)

    def init_cache(self, batch_size: int, max_length: int) -> StackedCache:
        """The stack's empty cache: its layers' caches with a leading layer axis, capacity `max_length` tokens."""
        one = self.layer.init_cache(batch_size, max_length)
        return StackedCache(jax.tree.map(lambda x: jnp.zeros((self.num_layers, *x.shape), x.dtype), one))

    def __call__(
        self,
        x: Float[Array, "B T E"],
        positions: Int[Array, "B T"],
        cache: StackedCache,
        segment_ids: Int[Array, "B T"] | None = None,
        *,
        advance: Int[Array, " B"] | None = None,
        keep_candidates: bool = False,
    ) -> tuple[jax.Array, StackedCache]:
        """`DecoderLayer.__call__` of each layer in turn (a scan over the layer axis); returns x and the cache.

        The stacked cache is the scan's carry: layer i reads slice i and writes it back in place. A recurrent
        stack with `keep_candidates` returns its layers' `RecurrentCandidates`, stacked, as the scan's outputs.
        Under `nnx.capture(fn, RoutingStats)` the layers' routers' records come out of the scan stacked (one
        `Routing` with a leading layer axis) and are sown on `layer`'s routers, as an unrolled layer's are.
        """
        graphdef, params = nnx.split(self.layer)
        layer_kwargs = dict(advance=advance, keep_candidates=keep_candidates)
        if keep_candidates and self.layer.recurrent:  # a new cache per layer, of another type: scan outputs

            def candidates_body(x, inputs):
                layer_params, layer_cache = inputs
                return nnx.merge(graphdef, layer_params)(x, positions, layer_cache, segment_ids, **layer_kwargs)

            x, candidates = jax.lax.scan(candidates_body, x, (params, cache.layers))
            return x, StackedCache(candidates)

        recording = hasattr(self.layer, "__captures__")  # under `nnx.capture` (training)

        def body(carry, inputs):
            x, stacked = carry
            layer_params, i = inputs
            layer_cache = jax.tree.map(lambda c: c[i], stacked)
            layer, args = nnx.merge(graphdef, layer_params), (x, positions, layer_cache, segment_ids)
            if recording:  # this layer's records, as scan outputs (stacked over the layers)
                (x, layer_cache), routing = nnx.capture(layer, RoutingStats)(*args, **layer_kwargs)
            else:
                (x, layer_cache), routing = layer(*args, **layer_kwargs), None
            stacked = jax.tree.map(lambda c, new: c.at[i].set(new), stacked, layer_cache)
            return (x, stacked), routing

        (x, stacked), routing = jax.lax.scan(body, (x, cache.layers), (params, jnp.arange(self.num_layers)))
        if recording:
            _sow_stacked(self.layer, routing)
        return x, StackedCache(stacked)


def _sow_stacked(layer: nnx.Module, routing: nnx.State) -> None:
    """Sows each record of `routing` (what the scan's layers sowed, stacked: every array [n, ...]) on the
    submodule of the stacked `layer` at its path, each router's calls one `Routing` with a leading layer axis."""
    for path, records in nnx.to_flat_state(routing):
        module = layer
        for name in path[:-1]:
            module = module[name] if isinstance(name, int) else getattr(module, name)
        module.sow(RoutingStats, path[-1], records.get_value(), reduce_fn=lambda before, new: before + new)
